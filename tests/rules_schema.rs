//! `tollgate rules-schema` and rules/schema.json: the committed schema is the binary's output,
//! every shipped rules file names and passes it, it refuses exactly the broken files whose
//! fault is one of structure, and the README's field reference lists exactly its fields.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use common::cli::{ok, tollgate};
use serde_json::Value;
use tollgate_rules::CompileOptions;

/// Broken files the schema refuses: each breaks a type, a required or unknown field, or an
/// enumerated name, which the parser refuses before any check of values.
const STRUCTURAL: &[(&str, &str)] = &[
    ("unknown-field.json", "`costs` is not a route field"),
    ("version-negative.json", "`version` is an unsigned integer"),
    ("version-fraction.json", "`version` is an integer"),
    ("version-string.json", "`version` is an integer, not a string"),
    (
        "encoded-slashes-unknown.json",
        "`decode` is not an encoded_slashes value",
    ),
    ("quota-per-unknown.json", "`week` is not a quota period"),
    ("paths-unknown.json", "`insensitive` is not a paths value"),
    ("dimension-unknown.json", "`fingerprnt` is not a dimension"),
    ("concurrency-min-negative.json", "`min` is an unsigned integer"),
    ("concurrency-adaptive-string.json", "`adaptive` is a boolean"),
    ("concurrency-adaptive-missing.json", "`adaptive` is required"),
    (
        "concurrency-unknown-field.json",
        "`window_ms` is not a concurrency field",
    ),
    ("tls-unknown-field.json", "`ca_file` is not a tls field"),
    ("balance-unknown.json", "`random` is not a balance"),
];

/// Broken files the schema accepts, and why it can't see their fault: the loader checks it
/// after parsing. A range or a string's syntax could be copied into the schema, but a copy of
/// a check can drift from it, and the loader's message says more than "does not match".
const SEMANTIC: &[(&str, &str)] = &[
    ("upgrade-h2c.json", "a protocol the gateway can't relay"),
    (
        "upgrade-websocket-on-post.json",
        "a protocol against the route's method",
    ),
    ("upgrade-not-a-token.json", "a protocol name's syntax"),
    (
        "idle-timeout-without-upgrade.json",
        "a field that needs another field",
    ),
    ("version-zero.json", "a value's range: version 1 or more"),
    ("version-too-large.json", "a value's range: version at most 2^53"),
    ("delay-zero-wait.json", "a value's range: a wait of 1 to 60000 ms"),
    (
        "block-for-bad-duration.json",
        "a duration's syntax, parsed by the loader",
    ),
    (
        "block-for-too-short.json",
        "a value's range: a block of 1 s to 24 h",
    ),
    (
        "delay-leased.json",
        "two fields that don't go together: a queue and a lease",
    ),
    (
        "zero-rate.json",
        "a rate's syntax and value, parsed by the loader",
    ),
    (
        "charge-on-bad-status.json",
        "a value's range: statuses 100 to 599",
    ),
    ("ipv6-prefix-too-long.json", "a value's range: 0 to 128"),
    ("concurrency-min-zero.json", "a value's range: min at least 1"),
    (
        "concurrency-max-too-large.json",
        "a value's range: max at most 1000000",
    ),
    (
        "post-paid-debt-too-large.json",
        "a bound that depends on the burst and the rate",
    ),
    (
        "route-path-not-canonical.json",
        "a path's canonical form, computed by the loader",
    ),
    ("route-method-lowercase.json", "a method's spelling"),
    ("route-method-connect.json", "a method the gateway refuses"),
    ("post-paid-bad-header.json", "a header name's syntax"),
    ("home-region-bad-name.json", "a Region name's syntax"),
    (
        "quota-timezone-unknown.json",
        "a name in the IANA time-zone database",
    ),
    ("cost-over-burst.json", "a cost against its limit's burst"),
    ("duplicate-key-hash.json", "one key's hash against another's"),
    (
        "missing-upstream.json",
        "a route naming an upstream that is not there",
    ),
    (
        "usage-with-upstream.json",
        "a usage route's upstream, which it may not have",
    ),
    ("concurrency-max-below-min.json", "max against min"),
    (
        "concurrency-min-above-max-in-flight.json",
        "min against the upstream's max_in_flight",
    ),
    (
        "post-paid-cost-not-reserve.json",
        "a route's cost against the limit's reserve",
    ),
    ("post-paid-leased.json", "cost_from_response with lease"),
    (
        "reserve-without-cost-from-response.json",
        "reserve without cost_from_response",
    ),
    ("charge-on-leased.json", "charge_on with lease"),
    ("concurrent-with-rate.json", "concurrent with rate"),
    (
        "concurrent-on-route.json",
        "concurrent with the limit's dimension",
    ),
    (
        "concurrent-cost-two.json",
        "a route's cost against a concurrent limit",
    ),
    ("global-route-limit.json", "scope with the limit's dimension"),
    ("global-security-limit.json", "scope with the limit's class"),
    (
        "home-region-on-capacity.json",
        "home_region with the limit's class",
    ),
    ("quota-on-route-limit.json", "quota with the limit's dimension"),
    (
        "quota-on-two-limits.json",
        "a quota on one limit against another's",
    ),
    (
        "jwt-route-without-settings.json",
        "a JWT route against the top-level jwt settings",
    ),
    (
        "jwt-plans-on-route-limit.json",
        "plans with the limit's dimension",
    ),
    (
        "ip-prefix-on-key-limit.json",
        "a prefix with the limit's dimension",
    ),
    ("jwt-alg-confusion.json", "the JWKS file the rules name"),
    (
        "upstream-scheme-unsupported.json",
        "a URL's scheme, parsed by the loader",
    ),
    ("tls-on-http.json", "tls against the URL's scheme"),
    ("tls-ca-missing.json", "the CA file the rules name"),
    ("tls-ca-not-pem.json", "the CA file's contents"),
    ("tls-bad-server-name.json", "a server name's syntax"),
    ("targets-empty.json", "an array's length: at least one target"),
    (
        "targets-weight-zero.json",
        "a value's range: a weight of 1 or more",
    ),
    (
        "targets-and-url.json",
        "two fields that don't go together: url and targets",
    ),
    (
        "balance-hash-without-key.json",
        "an upstream against the routes that reach it",
    ),
];

fn schema_path() -> PathBuf {
    common::repo().join("rules/schema.json")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn validator() -> jsonschema::Validator {
    jsonschema::validator_for(&read_json(&schema_path())).expect("rules/schema.json is a schema")
}

/// Why the schema refuses a document, one line per fault.
fn faults(v: &jsonschema::Validator, doc: &Value) -> String {
    v.iter_errors(doc)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_committed_schema_is_what_rules_schema_prints() {
    let printed = ok(&tollgate(&["rules-schema"]));
    let committed = std::fs::read_to_string(schema_path()).expect("rules/schema.json exists");
    assert!(
        printed == committed,
        "rules/schema.json is stale: regenerate it with `cargo run -- rules-schema > rules/schema.json`"
    );
    assert!(
        printed.ends_with("}\n"),
        "pretty-printed with one trailing newline"
    );
    let schema: Value = serde_json::from_str(&printed).unwrap();
    assert_eq!(schema["additionalProperties"], Value::Bool(false));
    for (name, def) in schema["$defs"].as_object().unwrap() {
        if def["type"] == "object" {
            assert_eq!(
                def["additionalProperties"],
                Value::Bool(false),
                "{name} takes unknown fields"
            );
        }
    }
}

#[test]
fn every_rules_file_names_the_schema_and_passes_it() {
    let v = validator();
    let mut files: Vec<_> = std::fs::read_dir(common::repo().join("rules"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        // The schema itself and the JWKS the demo names are not rules files.
        .filter(|p| !p.ends_with("schema.json") && !p.to_string_lossy().ends_with("-jwks.json"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    for f in &files {
        let doc = read_json(f);
        assert_eq!(
            doc["$schema"],
            "./schema.json",
            "{} does not name the schema",
            f.display()
        );
        assert!(v.is_valid(&doc), "{}:\n{}", f.display(), faults(&v, &doc));
    }
}

#[test]
fn the_schema_refuses_exactly_the_structurally_broken_files() {
    let v = validator();
    let dir = common::repo().join("tests/broken_rules");
    let mut on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    for (file, why) in STRUCTURAL.iter().chain(SEMANTIC) {
        assert!(
            on_disk.remove(*file),
            "{file} is listed twice or is not in {}",
            dir.display()
        );
        let path = dir.join(file);
        assert!(
            tollgate_rules::load(&path, CompileOptions::default()).is_err(),
            "{file}: the loader takes it"
        );
        let doc = read_json(&path);
        let structural = STRUCTURAL.iter().any(|(f, _)| f == file);
        assert_eq!(
            v.is_valid(&doc),
            !structural,
            "{file} ({why}): the schema should {}:\n{}",
            if structural { "refuse it" } else { "take it" },
            faults(&v, &doc)
        );
    }
    assert!(on_disk.is_empty(), "classify these broken files: {on_disk:?}");
    // The base the broken files come from passes, so each is refused for its one fault only.
    let base: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("valid-base.json.txt")).unwrap()).unwrap();
    assert!(v.is_valid(&base), "{}", faults(&v, &base));
}

#[test]
fn the_loader_takes_a_schema_field_and_no_other_unknown_one() {
    let base =
        std::fs::read_to_string(common::repo().join("tests/broken_rules/valid-base.json.txt")).unwrap();
    let mut doc: Value = serde_json::from_str(&base).unwrap();
    doc["$schema"] = "https://example.invalid/anything.json".into();
    let text = doc.to_string();
    tollgate_rules::compile(text.as_bytes(), "r.json", CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    doc["$schemas"] = "./schema.json".into();
    let err = tollgate_rules::compile(doc.to_string().as_bytes(), "r.json", CompileOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("r.json: $schemas: unknown field `$schemas`"),
        "{err}"
    );
    doc.as_object_mut().unwrap().remove("$schemas");
    doc["$schema"] = 7.into();
    let err = tollgate_rules::compile(doc.to_string().as_bytes(), "r.json", CompileOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("r.json: $schema: invalid type: integer `7`"),
        "{err}"
    );
    assert!(!validator().is_valid(&doc));
}

/// Follows `$ref`s and the `anyOf` that an optional field's `null` makes.
fn resolve<'a>(defs: &'a Value, mut node: &'a Value) -> &'a Value {
    loop {
        if let Some(r) = node["$ref"].as_str() {
            let name = r.strip_prefix("#/$defs/").expect("local refs only");
            node = &defs[name];
        } else if let Some(any) = node["anyOf"].as_array() {
            let mut not_null = any.iter().filter(|s| s["type"] != "null");
            match (not_null.next(), not_null.next()) {
                (Some(only), None) => node = only,
                _ => return node,
            }
        } else {
            return node;
        }
    }
}

/// What the reference must say of a field: whether it is required, and its default.
#[derive(Debug, PartialEq)]
struct Field {
    required: bool,
    default: Option<Value>,
}

/// Every field path in the schema: `*` for a map's entries, `[]` for a list's.
fn schema_fields(defs: &Value, node: &Value, prefix: &str, out: &mut BTreeMap<String, Field>) {
    let node = resolve(defs, node);
    let required: Vec<&str> = node["required"]
        .as_array()
        .map(|r| r.iter().map(|s| s.as_str().unwrap()).collect())
        .unwrap_or_default();
    if let Some(props) = node["properties"].as_object() {
        for (name, sub) in props {
            let path = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            let default = sub.get("default").filter(|d| !d.is_null()).cloned();
            out.insert(
                path.clone(),
                Field {
                    required: required.contains(&name.as_str()),
                    default,
                },
            );
            schema_fields(defs, sub, &path, out);
        }
    }
    if node["additionalProperties"].is_object() {
        schema_fields(defs, &node["additionalProperties"], &format!("{prefix}.*"), out);
    }
    if node["items"].is_object() {
        schema_fields(defs, &node["items"], &format!("{prefix}[]"), out);
    }
}

/// The README's reference rows: path → default cell.
fn readme_fields() -> BTreeMap<String, String> {
    let readme = std::fs::read_to_string(common::repo().join("README.md")).unwrap();
    let start = readme
        .find("<!-- rules-reference:start -->")
        .expect("the README marks its rules reference");
    let end = readme.find("<!-- rules-reference:end -->").expect("and its end");
    let mut rows = BTreeMap::new();
    for line in readme[start..end].lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<String> = line
            .replace("\\|", "\u{0}")
            .split('|')
            .map(|c| c.trim().replace('\u{0}', "|"))
            .collect();
        assert_eq!(cells.len(), 6, "a row of four cells: {line}");
        let path = cells[1].trim_matches('`').to_string();
        assert!(
            rows.insert(path.clone(), cells[3].clone()).is_none(),
            "{path} is listed twice"
        );
    }
    rows
}

#[test]
fn the_readme_reference_lists_every_field_of_the_schema() {
    let schema = read_json(&schema_path());
    let mut fields = BTreeMap::new();
    schema_fields(&schema["$defs"], &schema, "", &mut fields);
    assert!(fields.contains_key("limits.*.dimension") && fields.contains_key("keys[].sha256"));
    let rows = readme_fields();
    let missing: Vec<_> = fields.keys().filter(|p| !rows.contains_key(*p)).collect();
    let extra: Vec<_> = rows.keys().filter(|p| !fields.contains_key(*p)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "README field reference: missing {missing:?}, not in the schema {extra:?}"
    );
    for (path, field) in &fields {
        let cell = &rows[path];
        assert_eq!(
            cell == "required",
            field.required,
            "{path}: the README's default is {cell:?} but the schema has it {}required",
            if field.required { "" } else { "not " }
        );
        if let Some(d) = &field.default {
            assert!(
                cell.contains(&d.to_string()),
                "{path}: the README's default {cell:?} does not show the schema's {d}"
            );
        }
    }
}
