//! Replays every committed fuzz seed (`tests/fuzz_seeds/<target>/`) through the same function
//! its cargo-fuzz target calls (`tests/fuzz_harness`), so a fixed crash stays fixed without
//! libFuzzer or a nightly toolchain.

mod fuzz_harness;

use std::path::PathBuf;

/// Every seed of one target; fails when the directory is missing or empty, so a lost seed
/// directory can't turn this into a test that checks nothing.
fn seeds(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz_seeds")
        .join(target);
    let mut out: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("directory entry").path();
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (path, bytes)
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "{} holds no seeds", dir.display());
    out
}

/// Runs each seed on its own so a failure names the file; a panic in the library is the
/// failure this test exists to catch.
fn replay(target: &str, run: fn(&[u8])) {
    let mut failed = Vec::new();
    for (path, bytes) in seeds(target) {
        if std::panic::catch_unwind(|| run(&bytes)).is_err() {
            failed.push(path.display().to_string());
        }
    }
    assert!(failed.is_empty(), "seeds that panic: {failed:#?}");
}

#[test]
fn rules_seeds_do_not_panic() {
    replay("rules", fuzz_harness::rules);
}

#[test]
fn classify_seeds_do_not_panic() {
    replay("classify", fuzz_harness::classify);
}
