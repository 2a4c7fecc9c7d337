//! Where rules come from (a file, or the demo's built-in rules) and how a running gateway
//! loads them again: bytes in, a [`Snapshot`] or a [`RulesError`] out.

use std::path::{Path, PathBuf};

use http::HeaderValue;

use crate::compile::compile_with;
use crate::{ManagedKey, RulesError, Snapshot};

/// How to compile. No store asks anything of the rules now: on Redis Cluster a request whose
/// buckets lie in several hash slots is checked slot by slot (`tollgate_store::slots`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CompileOptions {}

/// The demo rules, built in so `tollgate demo` works from any directory.
pub(crate) const DEMO_RULES: &[u8] = include_bytes!("../../rules/demo.json");
/// The demo's JWKS, built in beside the demo rules that name it.
pub(crate) const DEMO_JWKS: &[u8] = include_bytes!("../../rules/demo-jwks.json");

/// Where the rules come from.
#[derive(Debug, Clone)]
pub enum RulesSource {
    File(PathBuf),
    Embedded {
        label: &'static str,
        bytes: &'static [u8],
    },
}

impl RulesSource {
    pub fn demo() -> RulesSource {
        RulesSource::Embedded {
            label: "rules/demo.json (built in)",
            bytes: DEMO_RULES,
        }
    }
}

/// Compiles rules the same way at start-up and on every reload, including the demo's
/// upstream override.
#[derive(Debug, Clone)]
pub struct RulesLoader {
    pub source: RulesSource,
    pub opts: CompileOptions,
    /// In demo mode every upstream's targets are the built-in demo upstream's instances;
    /// empty otherwise.
    pub upstream_override: Vec<http::uri::Authority>,
}

impl RulesLoader {
    pub fn load(&self) -> Result<Snapshot, RulesError> {
        self.load_with(&[])
    }

    /// [`RulesLoader::load`] with the keys made through the admin API after the file's own:
    /// an error in one of them names its field as `managed_keys[i]…`.
    pub fn load_with(&self, managed: &[ManagedKey]) -> Result<Snapshot, RulesError> {
        let mut snap = match &self.source {
            RulesSource::File(path) => load_file(path, self.opts, managed)?,
            RulesSource::Embedded { label, bytes } => {
                let builtin = |name: &str| match name {
                    "demo-jwks.json" => Ok(DEMO_JWKS.to_vec()),
                    other => Err(format!("{other:?} is not built in (only \"demo-jwks.json\" is)")),
                };
                compile_with(bytes, label, self.opts, &builtin, managed)?
            }
        };
        if let Some(auth) = self.upstream_override.first() {
            let host = HeaderValue::from_str(auth.as_str()).map_err(|_| RulesError {
                file: "(demo upstream)".into(),
                field: "upstreams".into(),
                reason: format!("{auth} can't be a Host header"),
            })?;
            for u in &mut snap.upstreams {
                u.authority = auth.clone();
                u.targets = self
                    .upstream_override
                    .iter()
                    .map(|a| crate::Target {
                        authority: a.clone(),
                        weight: 1,
                        max_in_flight: None,
                    })
                    .collect();
                u.host_header = host.clone();
                // The demo upstream speaks plain HTTP.
                u.scheme = http::uri::Scheme::HTTP;
                u.tls = None;
                // Several instances, which the demo stops and starts: checked once a second,
                // so one started again is back within about two.
                if self.upstream_override.len() > 1 && u.health.is_none() {
                    u.health = Some(crate::Health {
                        path: format!("{}/healthz", u.path_prefix),
                        interval: std::time::Duration::from_secs(1),
                        timeout: std::time::Duration::from_millis(500),
                        unhealthy_after: 2,
                        healthy_after: 2,
                    });
                }
            }
        }
        Ok(snap)
    }
}

/// Reads and compiles a rules file. Files it names (the JWKS) are read beside it.
///
/// ```
/// use std::path::Path;
///
/// use http::Method;
/// use tollgate_rules::{CompileOptions, RulesLoader, RulesSource, load};
///
/// let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../rules/demo.json");
/// let snap = load(&demo, CompileOptions::default()).unwrap();
/// let exports = snap.route(&Method::POST, "/v1/exports").expect("a route");
/// let mut costs: Vec<(&str, u64)> = snap.routes[exports]
///     .costs
///     .iter()
///     .map(|&(limit, cost)| (&*snap.limits[usize::from(limit)].name, cost))
///     .collect();
/// costs.sort_unstable();
/// assert_eq!(costs, [("exports", 1), ("plan", 10)]);
///
/// // `tollgate demo` compiles the same bytes, built in, the same way on every reload.
/// let loader = RulesLoader {
///     source: RulesSource::demo(),
///     opts: CompileOptions::default(),
///     upstream_override: Vec::new(),
/// };
/// assert_eq!(loader.load().unwrap().digest, snap.digest);
///
/// let missing = load(Path::new("no/such/rules.json"), CompileOptions::default()).unwrap_err();
/// assert_eq!((missing.file.as_str(), missing.field.as_str()), ("no/such/rules.json", "(file)"));
/// ```
pub fn load(path: &Path, opts: CompileOptions) -> Result<Snapshot, RulesError> {
    load_file(path, opts, &[])
}

fn load_file(path: &Path, opts: CompileOptions, managed: &[ManagedKey]) -> Result<Snapshot, RulesError> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| RulesError {
        file: file.clone(),
        field: "(file)".into(),
        reason: format!("cannot read: {e}"),
    })?;
    compile_read(&bytes, &file, opts, managed)
}

/// Parses and compiles rules from bytes; `file` names them in errors, and files they name
/// (the JWKS) are read relative to its directory.
///
/// One upstream, one limit and one route: a request's route is found by its method and path,
/// and the route names the limit it pays and what it costs there.
///
/// ```
/// use http::Method;
/// use tollgate_rules::{CompileOptions, compile};
///
/// let rules = r#"{
///     "version": 1,
///     "upstreams": {"orders": {"url": "http://127.0.0.1:9"}},
///     "limits": {"per_ip": {"dimension": "ip", "rate": "10/1s", "burst": 20}},
///     "routes": [{"method": "GET", "path": "/v1/orders", "upstream": "orders",
///                 "cost": {"per_ip": 2}}]
/// }"#;
/// let snap = compile(rules.as_bytes(), "rules.json", CompileOptions::default()).unwrap();
///
/// let i = snap.route(&Method::GET, "/v1/orders/42").expect("the /v1/orders route");
/// let (limit, cost) = snap.routes[i].costs[0];
/// assert_eq!(cost, 2);
/// let limit = &snap.limits[usize::from(limit)];
/// assert_eq!(&*limit.name, "per_ip");
/// let params = limit.numbers.as_ref().expect("its own numbers").params;
/// assert_eq!((params.rate.tokens, params.rate.period_us, params.burst), (10, 1_000_000, 20));
/// assert_eq!(snap.route(&Method::POST, "/v1/orders"), None);
///
/// // A bad document is refused, and the error names the file and the field.
/// let bad = rules.replace("10/1s", "ten/1s");
/// let e = compile(bad.as_bytes(), "rules.json", CompileOptions::default()).unwrap_err();
/// assert_eq!((e.file.as_str(), e.field.as_str()), ("rules.json", "limits.per_ip.rate"));
/// assert!(e.reason.contains("\"ten\" is not a whole number"), "{e}");
/// ```
pub fn compile(bytes: &[u8], file: &str, opts: CompileOptions) -> Result<Snapshot, RulesError> {
    compile_read(bytes, file, opts, &[])
}

fn compile_read(
    bytes: &[u8],
    file: &str,
    opts: CompileOptions,
    managed: &[ManagedKey],
) -> Result<Snapshot, RulesError> {
    let dir = Path::new(file)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let read = move |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))
    };
    compile_with(bytes, file, opts, &read, managed)
}
