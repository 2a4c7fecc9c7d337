//! Futures put on the heap without passing through the stack.
//!
//! `Box::pin(f())` builds `f`'s future on the stack and then copies all of it into the box:
//! an async fn's future is as large as its largest state (the express lane's is 3,360 bytes),
//! though at its start it holds only its arguments. Allocating first and building the future
//! in the allocation lets the compiler write those arguments straight to the heap.

use std::future::Future;
use std::pin::Pin;

/// `Box::pin(make())`, built in place.
#[inline(always)]
pub(crate) fn boxed<F: Future>(make: impl FnOnce() -> F) -> Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), make()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_boxed_future_runs_as_its_function_would() {
        async fn twice(x: u64) -> u64 {
            tokio::task::yield_now().await;
            x * 2
        }
        assert_eq!(boxed(|| twice(21)).await, 42);
    }
}
