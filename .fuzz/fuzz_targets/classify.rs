//! Fuzz target `classify`: a request head (method, path, headers, peer) through sanitizing,
//! identity, routing, the plan, a store check and the decision, against the demo rules.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_fuzz::classify(data));
