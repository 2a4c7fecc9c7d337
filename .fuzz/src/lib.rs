//! The fuzz targets' bodies, kept in `tests/fuzz_harness` so `cargo test` replays committed
//! seeds through the very same code.

#[path = "../../tests/fuzz_harness/mod.rs"]
mod harness;

pub use harness::{classify, rules};
