//! Every rules file shipped in rules/ compiles, and the list is not empty.

use tollgate_rules::{self as rules, CompileOptions};

mod common;

#[test]
fn every_rules_file_compiles() {
    let dir = common::repo().join("rules");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("rules/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no rules files found in {}", dir.display());
    for f in &files {
        let snap = rules::load(f, CompileOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        assert!(snap.version >= 1, "{}", f.display());
        assert!(!snap.routes.is_empty(), "{} has no routes", f.display());
    }
}
