//! Read and write buffers lent to connections while they are busy and kept by each thread
//! between lendings.
//!
//! An idle connection holds no buffer (issue 24), so every request of a keep-alive client that
//! waits for its answer before the next request takes its buffers again: two or three of 8 KiB.
//! jemalloc's per-thread cache keeps few blocks of that size, and refilling it cost about 1,500
//! instructions a request (callgrind). A thread keeps up to [`KEEP`] of them here instead.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

use bytes::BytesMut;

/// The room of a lent buffer.
pub(crate) const SIZE: usize = 8 * 1024;
/// Buffers a thread keeps for the next lending: 512 KiB at most.
const KEEP: usize = 64;
/// A buffer grown past this (a large body relayed) is freed rather than kept.
const LARGEST: usize = 4 * SIZE;

thread_local! {
    static FREE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// An empty buffer with room for at least [`SIZE`] bytes.
pub fn take() -> BytesMut {
    FREE.with(|f| f.borrow_mut().pop())
        .unwrap_or_else(|| BytesMut::with_capacity(SIZE))
}

/// Gives back a buffer that is no longer needed. It is kept only when nothing else shares its
/// memory any more (a request's bytes split from it have all been dropped) and it has not grown
/// large; otherwise it is freed.
pub fn give(mut b: BytesMut) {
    b.clear();
    if b.capacity() > LARGEST || !b.try_reclaim(SIZE) {
        return;
    }
    FREE.with(|f| {
        let mut f = f.borrow_mut();
        if f.len() < KEEP {
            f.push(b);
        }
    });
}

/// A lent buffer, given back when dropped.
#[derive(Default)]
pub(crate) struct Lent(BytesMut);

impl Lent {
    #[cfg(test)]
    pub fn take() -> Lent {
        Lent(take())
    }
}

impl Deref for Lent {
    type Target = BytesMut;
    fn deref(&self) -> &BytesMut {
        &self.0
    }
}

impl DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut BytesMut {
        &mut self.0
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        give(std::mem::take(&mut self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept() -> usize {
        FREE.with(|f| f.borrow().len())
    }

    #[test]
    fn a_buffer_comes_back_whole_or_not_at_all() {
        std::thread::spawn(|| {
            let mut b = take();
            assert!(b.capacity() >= SIZE);
            b.extend_from_slice(b"GET / HTTP/1.1\r\n\r\nrest");
            let ptr = b.as_ptr();
            give(b);
            assert_eq!(kept(), 1);
            let again = take();
            assert_eq!(again.as_ptr(), ptr, "the kept buffer was not lent again");
            assert!(again.is_empty() && again.capacity() >= SIZE);

            // Shared with a request's bytes still alive: not kept, so those bytes stay as
            // they are.
            let mut b = again;
            b.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
            let request = b.split_to(18).freeze();
            give(b);
            assert_eq!(kept(), 0, "a buffer whose memory a request still reads was kept");
            assert_eq!(&request[..], b"GET / HTTP/1.1\r\n\r\n");

            // Grown large: freed.
            let mut big = take();
            big.reserve(LARGEST * 2);
            give(big);
            assert_eq!(kept(), 0);

            // At most KEEP.
            let many: Vec<BytesMut> = (0..KEEP + 5).map(|_| take()).collect();
            many.into_iter().for_each(give);
            assert_eq!(kept(), KEEP);
            drop(Lent::take());
            assert_eq!(kept(), KEEP);
        })
        .join()
        .unwrap();
    }
}
