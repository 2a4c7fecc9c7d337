//! The workspace's layers (src/ARCHITECTURE.md), held against what the crates' manifests say:
//! a crate may depend only on crates of a lower layer, and the low layers may not reach for a
//! runtime, sockets or HTTP. A new arrow that breaks this fails here before review.

use std::collections::BTreeMap;
use std::process::Command;

/// Each crate's layer; a crate may depend on crates of a strictly lower one.
const LAYERS: &[(&str, u8)] = &[
    ("tollgate-limit", 0),
    ("tollgate-http1", 0),
    ("tollgate-hello", 0),
    ("tollgate-telemetry", 1),
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
