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

/// Reads and compiles a rules file.
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
