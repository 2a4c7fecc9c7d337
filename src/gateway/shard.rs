//! Which serving thread this is: `--threads N` runs N shards, each a thread with a
//! single-threaded runtime and a listener of its own on the public port (`server::run_shards`).
//!
//! A connection lives and dies on the shard that accepted it, so whatever it uses that is tied
//! to a runtime (a socket's readiness, a timer) is best kept per shard too: an upstream socket
//! opened on one shard and read on another would have its readiness noticed by the first
//! shard's reactor, which may be busy, and handed over with a wake-up between threads. The
//! upstream pools keep one list per shard for that reason.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Shards this process serves on; set once before serving, read when per-shard state is made.
static COUNT: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// Says how many shards will serve; per-shard state made after this has a place for each.
pub(crate) fn set_count(n: usize) {
    COUNT.store(n.max(1), Ordering::Relaxed);
}

/// How many shards serve.
pub fn count() -> usize {
    COUNT.load(Ordering::Relaxed)
}

/// Marks the calling thread as shard `i`.
pub(crate) fn enter(i: usize) {
    CURRENT.with(|c| c.set(i));
}

/// The shard of the calling thread: 0 on any thread that is not a shard's (the main thread,
/// which serves shard 0, and blocking or helper threads).
pub fn current() -> usize {
    CURRENT.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_is_shard_zero_until_it_enters_one() {
        std::thread::spawn(|| {
            assert_eq!(current(), 0);
            enter(3);
            assert_eq!(current(), 3);
        })
        .join()
        .unwrap();
        assert_eq!(current(), 0, "entering is per thread");
    }
}
