//! The `tollgate` binary run to its end, as a user runs a subcommand: its output, and asserts
//! that it succeeded or failed that print what it said.

use std::path::Path;
use std::process::{Command, Output};

pub fn tollgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .expect("run tollgate")
}

/// Its standard output, after checking it succeeded.
pub fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// Its standard error, after checking it failed.
pub fn fails(o: &Output) -> String {
    assert!(
        !o.status.success(),
        "expected failure, got success:\n{}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}
