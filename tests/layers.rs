//! The workspace's layers (src/ARCHITECTURE.md), held against what the crates' manifests say:
//! a crate may depend only on crates of a lower layer, and the low layers may not reach for a
//! runtime, sockets or HTTP. A new arrow that breaks this fails here before review. Beside
//! them: the fixed top level, no large tracked file, and the lengths a newcomer reads at once.

use std::collections::BTreeMap;
use std::process::Command;

/// Each crate's layer; a crate may depend on crates of a strictly lower one.
const LAYERS: &[(&str, u8)] = &[
    ("tollgate-limit", 0),
    ("tollgate-http1", 0),
    ("tollgate-hello", 0),
    ("tollgate-telemetry", 1),
    ("tollgate-access", 1),
    ("tollgate-rules", 1),
    ("tollgate-regions", 1),
    ("tollgate-store", 2),
    ("tollgate-meter", 2),
    ("tollgate-keys", 2),
    ("tollgate-gateway", 3),
    ("tollgate-replay", 3),
    ("tollgate-fleet", 4),
    ("tollgate-testkit", 5),
    ("tollgate", 5),
];

/// Outside crates a layer must do without, and why.
const NEVER: &[(&str, &[&str], &str)] = &[
    (
        "tollgate-limit",
        &["tokio", "http", "hyper", "fred", "prometheus-client"],
        "the limiter core does no I/O and knows no HTTP",
    ),
    (
        "tollgate-http1",
        &["tokio", "hyper"],
        "the HTTP/1 reader works on bytes, not sockets",
    ),
    (
        "tollgate-hello",
        &["tokio", "http", "hyper", "rustls", "tokio-rustls"],
        "the ClientHello reader works on bytes: the gateway peeks them off the socket",
    ),
    (
        "tollgate-rules",
        &["tokio", "hyper", "fred", "notify"],
        "the rules are plain data: no socket, task or file watch",
    ),
    (
        "tollgate-regions",
        &["tokio", "http", "hyper", "fred"],
        "the share decisions are pure: the live agent brings the clock and the store",
    ),
    (
        "tollgate-access",
        &["tokio", "hyper", "http"],
        "reaching a store is settings and files: the store and the meter bring the connections",
    ),
    (
        "tollgate-store",
        &["hyper", "http"],
        "the store knows buckets, not requests",
    ),
    (
        "tollgate-keys",
        &["hyper", "http"],
        "the keys are records and stores: the gateway brings the admin API's HTTP",
    ),
];

fn manifests() -> BTreeMap<String, Vec<(String, bool)>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let mut crates = BTreeMap::new();
    for p in meta["packages"].as_array().expect("packages") {
        let deps = p["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            // (name, is a normal dependency): dev-dependencies may reach anywhere.
            .map(|d| (d["name"].as_str().unwrap().to_string(), d["kind"].is_null()))
            .collect();
        crates.insert(p["name"].as_str().unwrap().to_string(), deps);
    }
    crates
}

#[test]
fn every_crate_has_a_layer_and_depends_only_downwards() {
    let crates = manifests();
    let layer = |name: &str| LAYERS.iter().find(|(n, _)| *n == name).map(|&(_, l)| l);
    let mut broken = Vec::new();
    for (name, deps) in &crates {
        let Some(mine) = layer(name) else {
            broken.push(format!(
                "{name} has no layer in tests/layers.rs and src/ARCHITECTURE.md"
            ));
            continue;
        };
        for (dep, normal) in deps {
            if !normal || !dep.starts_with("tollgate") {
                continue;
            }
            match layer(dep) {
                Some(l) if l < mine => {}
                Some(l) => broken.push(format!("{name} (layer {mine}) depends on {dep} (layer {l})")),
                None => broken.push(format!("{name} depends on {dep}, which has no layer")),
            }
        }
    }
    assert_eq!(
        crates.len(),
        LAYERS.len(),
        "the workspace's crates and the layer table differ: {:?}",
        crates.keys().collect::<Vec<_>>()
    );
    assert!(broken.is_empty(), "layering broken:\n{}", broken.join("\n"));
}

#[test]
fn low_layers_stay_free_of_io_and_http() {
    let crates = manifests();
    let mut broken = Vec::new();
    for (name, never, why) in NEVER {
        let deps = crates
            .get(*name)
            .unwrap_or_else(|| panic!("{name} is not in the workspace"));
        for (dep, normal) in deps {
            if *normal && never.contains(&dep.as_str()) {
                broken.push(format!("{name} depends on {dep}: {why}"));
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_gateway_carries_no_harness() {
    let crates = manifests();
    let gateway = &crates["tollgate-gateway"];
    for harness in ["tollgate-fleet", "tollgate-testkit", "tollgate-replay"] {
        assert!(
            !gateway.iter().any(|(d, _)| d == harness),
            "tollgate-gateway depends on {harness}, a tool or harness"
        );
    }
}

/// The crates and features that hold test code: stores that fail on purpose, fake lessors,
/// processes that die with their handles for tests. A product built on them ships fakes.
const TEST_CODE: &[&str] = &["tollgate-testkit v", "feature \"fakes\""];

#[test]
fn the_binary_carries_no_test_code() {
    // The resolved tree, not the manifests: a harness reached through fleet counts too.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "-p",
            "tollgate",
            "-e",
            "normal,features",
            "--prefix",
            "none",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        tree.lines().any(|l| l.starts_with("tollgate-store v")),
        "cargo tree printed no tollgate-store: {tree}"
    );
    let mut found: Vec<&str> = tree
        .lines()
        .filter(|l| TEST_CODE.iter().any(|t| l.contains(t)))
        .collect();
    found.sort_unstable();
    found.dedup();
    assert!(
        found.is_empty(),
        "the tollgate binary's normal dependencies hold test code: {found:?}"
    );
}

/// What the top level may hold: the layout the project fixed, hidden files beside it.
const TOP_LEVEL: &[&str] = &[
    "Cargo.toml",
    "Cargo.lock",
    "src",
    "rules",
    "lua",
    "certs",
    "tests",
    "benches",
    "Dockerfile",
    "README.md",
    "rustfmt.toml",
];

/// The largest file the repository may track: a bigger one is a build output or a download
/// that slipped in, and every clone pays for it.
const MAX_TRACKED_BYTES: u64 = 1 << 20;

/// The files git tracks, relative to the repository's root.
fn tracked() -> Vec<String> {
    let out = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("git runs");
    assert!(
        out.status.success(),
        "git ls-files: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files: Vec<String> = out
        .stdout
        .split(|&b| b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    assert!(files.len() > 100, "git ls-files found only {} files", files.len());
    files
}

#[test]
fn the_top_level_holds_the_fixed_layout_and_no_large_file() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut stray = Vec::new();
    let mut large = Vec::new();
    for f in tracked() {
        let top = f.split('/').next().unwrap_or_default();
        if !top.starts_with('.') && !TOP_LEVEL.contains(&top) {
            stray.push(f.clone());
        }
        let len = std::fs::metadata(root.join(&f)).map(|m| m.len()).unwrap_or(0);
        if len > MAX_TRACKED_BYTES {
            large.push(format!("{f} ({len} bytes)"));
        }
    }
    assert!(stray.is_empty(), "tracked outside the fixed top level: {stray:?}");
    assert!(large.is_empty(), "tracked files over 1 MiB: {large:?}");
}

/// The longest a function outside tests may run, from its `fn` line to its closing brace.
const MAX_FN_LINES: usize = 120;
/// The longest a source file under `src/` may be, and a test file.
const MAX_SRC_LINES: usize = 1000;
const MAX_TEST_LINES: usize = 800;

/// Whether `line` (trimmed) opens a function: `fn`, after any of `pub(…)`, `const`, `async`,
/// `unsafe`, `extern "…"`.
fn opens_fn(trimmed: &str) -> bool {
    let mut rest = trimmed;
    loop {
        if let Some(r) = rest.strip_prefix("fn ") {
            return !r.is_empty();
        }
        let word = if rest.starts_with("pub(") {
            match rest.find(") ") {
                Some(i) => i + 2,
                None => return false,
            }
        } else if let Some(abi) = rest.strip_prefix("extern \"") {
            match abi.find("\" ") {
                Some(i) => 8 + i + 2,
                None => return false,
            }
        } else {
            match ["pub ", "const ", "async ", "unsafe "]
                .iter()
                .find(|p| rest.starts_with(**p))
            {
                Some(p) => p.len(),
                None => return false,
            }
        };
        rest = &rest[word..];
    }
}

/// Where the item opened on line `i` ends: the first later line at its indent that is its
/// closing brace, or that ends a body-less declaration with `;`. rustfmt keeps both at the
/// item's indent.
fn item_end(lines: &[&str], i: usize) -> usize {
    let line = lines[i];
    let trimmed = line.trim_start();
    if trimmed.ends_with('}') || trimmed.ends_with(';') {
        return i;
    }
    let indent = &line[..line.len() - trimmed.len()];
    for (j, l) in lines.iter().enumerate().skip(i + 1) {
        if let Some(rest) = l.strip_prefix(indent)
            && !rest.starts_with(char::is_whitespace)
            && (rest == "}" || rest.ends_with(';') || rest.starts_with("};"))
        {
            return j;
        }
    }
    lines.len() - 1
}

/// Functions in `text` that run past [`MAX_FN_LINES`], as `name (N lines)`, leaving out every
/// item under `#[cfg(test)]`.
fn long_functions(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut long = Vec::new();
    let mut test_item = false;
    let mut i = 0;
    while i < lines.len() {
        let trimmed = lines[i].trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            test_item = true;
        } else if trimmed.starts_with("#[") || trimmed.starts_with("///") || trimmed.is_empty() {
            // Attributes and docs belong to the item below.
        } else if test_item {
            test_item = false;
            i = item_end(&lines, i);
        } else if opens_fn(trimmed) {
            let end = item_end(&lines, i);
            let n = end - i + 1;
            if n > MAX_FN_LINES {
                let name = trimmed.split("fn ").nth(1).unwrap_or_default();
                let name = name.split(['(', '<']).next().unwrap_or_default();
                long.push(format!("{name} ({n} lines)"));
            }
        }
        i += 1;
    }
    long
}

#[test]
fn the_long_function_finder_sees_what_it_must() {
    let body = "    let x = 1;\n".repeat(MAX_FN_LINES);
    let long = format!("pub(crate) async fn big(a: u8) -> u8 {{\n{body}}}\n");
    assert_eq!(
        long_functions(&long),
        vec![format!("big ({} lines)", MAX_FN_LINES + 2)]
    );
    let in_tests = format!("#[cfg(test)]\nmod tests {{\n    fn big() {{\n{body}    }}\n}}\n");
    assert!(long_functions(&in_tests).is_empty());
    let short = "trait T {\n    fn f(&self,\n        x: u8,\n    ) -> u8;\n}\nfn g() {}\n";
    assert!(long_functions(short).is_empty());
}

/// Held so a newcomer reads the code a screen at a time: every function outside tests within
/// [`MAX_FN_LINES`], every source file within [`MAX_SRC_LINES`], every test file within
/// [`MAX_TEST_LINES`].
#[test]
fn functions_and_files_stay_within_their_lengths() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut over = Vec::new();
    for f in tracked() {
        if !f.ends_with(".rs") {
            continue;
        }
        let text = std::fs::read_to_string(root.join(&f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        let parts: Vec<&str> = f.split('/').collect();
        let test_file = parts[0] == "tests"
            || parts.contains(&"tests")
            || f.ends_with("/tests.rs")
            || parts[0] == "benches";
        let cap = if test_file { MAX_TEST_LINES } else { MAX_SRC_LINES };
        let n = text.lines().count();
        if n > cap {
            over.push(format!("{f}: {n} lines, over {cap}"));
        }
        if parts[0] == "src" && !test_file {
            for l in long_functions(&text) {
                over.push(format!("{f}: fn {l}, over {MAX_FN_LINES}"));
            }
        }
    }
    assert!(over.is_empty(), "past their lengths:\n{}", over.join("\n"));
}
