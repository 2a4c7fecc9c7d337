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
        // The schema and the JWKS the demo rules name are not rules files.
        .filter(|p| !p.ends_with("schema.json") && !p.to_string_lossy().ends_with("-jwks.json"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no rules files found in {}", dir.display());
    for f in &files {
        let snap = rules::load(f, CompileOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        assert!(snap.version >= 1, "{}", f.display());
        assert!(!snap.routes.is_empty(), "{} has no routes", f.display());
    }
}

/// A quota on the plan limit is every key's; a key's own quota replaces it.
#[test]
fn a_plan_quota_is_every_keys_unless_the_key_sets_its_own() {
    use tollgate_rules::quota::Per;
    let text = common::demo_json();
    let mut r: serde_json::Value = serde_json::from_str(&text).unwrap();
    r["limits"]["plan"]["quota"] = serde_json::json!({"per": "month", "limit": 1000000});
    let k8 = r["keys"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|k| k["id"] == "k-8")
        .unwrap();
    k8["quota"] = serde_json::json!({"per": "day", "limit": 5, "timezone": "Asia/Tokyo"});
    let snap = rules::compile(r.to_string().as_bytes(), "t.json", CompileOptions::default()).unwrap();
    let quota = |id: &str| {
        let k = &snap.keys[snap.key_by_id(id).unwrap()];
        k.quota.as_ref().map(|q| (q.per, q.limit, q.zone_name.clone()))
    };
    assert_eq!(quota("k-7"), Some((Per::Month, 1_000_000, "UTC".to_string())));
    assert_eq!(quota("k-8"), Some((Per::Day, 5, "Asia/Tokyo".to_string())));
}
