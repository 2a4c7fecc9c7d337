//! Fuzz target `rules`: arbitrary bytes through `rules::compile` (alone and for Redis
//! Cluster) and `summary` on whatever compiles.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_fuzz::rules(data));
