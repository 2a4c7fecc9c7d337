//! The compiler: a parsed rules file checked and turned into a [`Snapshot`], one part per
//! file in the order it runs: upstreams, limits, keys, routes. Every error names the file,
//! the field and the reason.

use crate::routes;

use sha2::{Digest, Sha256};
use tollgate_http1::path::EncodedSlashes;
use tollgate_limit::bucket::BucketParams;
use tollgate_limit::bucket::Rate;

use crate::BTreeMap;
use crate::CompileOptions;
use crate::HashMap;
use crate::Identity;
use crate::Limit;
use crate::ManagedKey;
use crate::Numbers;
use crate::RawEncodedSlashes;
use crate::RawRules;
use crate::Route;
use crate::RulesError;
use crate::Snapshot;
use crate::SystemTime;
use crate::Upstream;
use crate::jwt;
use crate::policy_value;

mod key;
mod limit;
mod route;
mod upstream;

pub use key::hash_secret;

/// Reads a file the rules name, by the name as written.
type ReadNamed<'a> = &'a dyn Fn(&str) -> Result<Vec<u8>, String>;

pub(crate) fn compile_with(
    bytes: &[u8],
    file: &str,
    opts: CompileOptions,
    read: ReadNamed<'_>,
    managed: &[ManagedKey],
) -> Result<Snapshot, RulesError> {
    // Everything but the keys, which this pass skips: they are read one at a time later, each
    // compiled and dropped before the next, so a file's keys are never all held as parsed.
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let raw: RawRules = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        parse_error(file, path, e.into_inner())
    })?;
    de.end().map_err(|e| RulesError {
        file: file.to_string(),
        field: "(top level)".into(),
        reason: format!("trailing data after the rules object: {e}"),
    })?;
    let digest = hex::encode(Sha256::digest(bytes));
    // An option added later must be handled here.
    let CompileOptions {} = opts;
    Compiler {
        file,
        read,
        bytes,
        managed,
    }
    .run(raw, digest)
}

/// A parse error at `path` (serde_path_to_error's form, `.` for the top level).
fn parse_error(file: &str, path: String, inner: serde_json::Error) -> RulesError {
    let field = if path == "." {
        "(top level)".to_string()
    } else {
        path
    };
    let reason = match field.as_str() {
        "version" => format!("must be a positive integer ({inner})"),
        _ => inner.to_string(),
    };
    RulesError {
        file: file.to_string(),
        field,
        reason,
    }
}

/// The largest rules `version`: 2^53, past which a float64 no longer counts by one.
const MAX_VERSION: u64 = 1 << 53;

/// Numbers each snapshot this process compiles, in order: a key made through the admin API
/// changes the snapshot without changing the file's version.
static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

struct Compiler<'a> {
    file: &'a str,
    read: ReadNamed<'a>,
    /// The whole file, for the pass that reads its keys.
    bytes: &'a [u8],
    /// Keys made through the admin API, compiled after the file's.
    managed: &'a [ManagedKey],
}

/// The compiled upstreams, and where each is by name for the routes that name it.
struct Upstreams {
    list: Vec<Upstream>,
    by_name: HashMap<String, usize>,
}

/// The compiled limits, and where each is by name for the keys, routes and
/// `unauthenticated` that name it.
struct Limits<'r> {
    list: Vec<Limit>,
    by_name: BTreeMap<&'r str, usize>,
}

impl Compiler<'_> {
    fn err(&self, field: impl Into<String>, reason: impl Into<String>) -> RulesError {
        RulesError {
            file: self.file.to_string(),
            field: field.into(),
            reason: reason.into(),
        }
    }

    fn numbers(&self, field: &str, name: &str, rate: &str, burst: u64) -> Result<Numbers, RulesError> {
        let rate = Rate::parse(rate).map_err(|e| self.err(format!("{field}.rate"), e))?;
        let params = BucketParams::new(rate, burst).map_err(|e| self.err(field, e.to_string()))?;
        let policy = policy_value(name, &params).map_err(|e| self.err(field, e))?;
        Ok(Numbers { params, policy })
    }

    fn run(&self, raw: RawRules, digest: String) -> Result<Snapshot, RulesError> {
        if raw.version == 0 {
            return Err(self.err("version", "must be a positive integer (1 or more)"));
        }
        // A version only goes up, so one past what a JSON tool reads exactly (a float64
        // rounds it, and `jq .version + 1` writes it back unchanged) would leave every later
        // file ignored until a restart.
        if raw.version > MAX_VERSION {
            return Err(self.err(
                "version",
                format!("must be at most 2^53 ({MAX_VERSION}), the largest integer JSON tools keep exact"),
            ));
        }
        // Each step looks names up in what the steps before it compiled: keys name limits;
        // routes name upstreams and limits, and are checked against every key's numbers.
        let upstreams = self.upstreams(&raw)?;
        let mut limits = self.limits(&raw)?;
        let mut keys = self.keys(&raw, &limits)?;
        self.managed_keys(&raw, &limits, &mut keys)?;
        self.owing(&mut limits, &mut keys)?;
        let mut routes = self.routes(&raw, &upstreams, &limits, keys.keys())?;
        self.hashed_by_key(&upstreams, &routes)?;
        sort_routes(&mut routes);
        let matcher = routes::Matcher::new(&routes);
        let unauthenticated = self.unauthenticated(&raw, &limits)?;
        let jwt = self.jwt(&raw)?;
        if jwt.is_none()
            && let Some(i) = raw.routes.iter().position(|r| r.identity == Identity::Jwt)
        {
            return Err(self.err(
                format!("routes[{i}].identity"),
                "a JWT route needs the top-level \"jwt\" settings (its JWKS, issuer and audience)",
            ));
        }
        Ok(Snapshot {
            version: raw.version,
            serial: SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            digest,
            source: self.file.to_string(),
            loaded_at: SystemTime::now(),
            upstreams: upstreams.list,
            limits: limits.list,
            keys: keys.finish(),
            method_override: routes.iter().any(|r| r.method_override),
            routes,
            matcher,
            unauthenticated,
            jwt,
        })
    }

    fn jwt(&self, raw: &RawRules) -> Result<Option<jwt::JwtConfig>, RulesError> {
        let Some(j) = &raw.jwt else {
            return Ok(None);
        };
        let claim = |field: &str, c: &Option<String>, default: Option<&str>| match c {
            Some(c) if c.is_empty() => Err(self.err(format!("jwt.{field}"), "must not be empty")),
            Some(c) => Ok(Some(c.clone())),
            None => Ok(default.map(str::to_string)),
        };
        for (field, v) in [
            ("jwks", &j.jwks),
            ("issuer", &j.issuer),
            ("audience", &j.audience),
        ] {
            if v.is_empty() {
                return Err(self.err(format!("jwt.{field}"), "must not be empty"));
            }
        }
        let leeway_s = j.leeway_s.unwrap_or(jwt::DEFAULT_LEEWAY_S);
        if leeway_s > jwt::MAX_LEEWAY_S {
            return Err(self.err(
                "jwt.leeway_s",
                format!(
                    "{leeway_s} s would keep expired tokens alive; at most {}",
                    jwt::MAX_LEEWAY_S
                ),
            ));
        }
        let bytes = (self.read)(&j.jwks).map_err(|e| self.err("jwt.jwks", e))?;
        let checks = jwt::Checks {
            issuer: &j.issuer,
            audience: &j.audience,
            leeway_s,
        };
        let keys = jwt::keys(&bytes, &checks)
            .map_err(|(f, r)| self.err("jwt.jwks", format!("{}: {f}: {r}", j.jwks)))?;
        Ok(Some(jwt::JwtConfig {
            jwks_path: j.jwks.clone(),
            keys,
            issuer: j.issuer.clone(),
            audience: j.audience.clone(),
            leeway_s,
            key_claim: claim("key_claim", &j.key_claim, Some("sub"))?.unwrap_or_default(),
            tenant_claim: claim("tenant_claim", &j.tenant_claim, None)?,
        }))
    }
}

/// Longest prefix first, and a route with a method before the catch-all of the same prefix:
/// [`Snapshot::route`] takes the first route that matches.
fn sort_routes(routes: &mut [Route]) {
    routes.sort_by(|a, b| {
        b.prefix
            .len()
            .cmp(&a.prefix.len())
            .then_with(|| a.method.is_none().cmp(&b.method.is_none()))
    });
}

fn slashes(raw: Option<RawEncodedSlashes>) -> Option<EncodedSlashes> {
    raw.map(|s| match s {
        RawEncodedSlashes::Refuse => EncodedSlashes::Refuse,
        RawEncodedSlashes::Keep => EncodedSlashes::Keep,
    })
}

/// Rules files for the compiler's unit tests: one upstream, one limit and one route, which each
/// test changes where its part is.
#[cfg(test)]
pub(super) mod testing {
    use serde_json::{Value, json};

    pub fn base() -> Value {
        json!({
            "version": 1,
            "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
            "limits": {"per_key": {"dimension": "key", "rate": "10/1s", "burst": 10}},
            "routes": [{"method": "GET", "path": "/v1", "upstream": "u", "cost": {"per_key": 1}}]
        })
    }

    pub fn ok(rules: &Value) -> crate::Snapshot {
        crate::compile(rules.to_string().as_bytes(), "rules.json", Default::default())
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `rules` with keys made through the admin API after the file's.
    pub fn with_managed(
        rules: &Value,
        managed: &[crate::ManagedKey],
    ) -> Result<crate::Snapshot, crate::RulesError> {
        let no_files = |name: &str| Err(format!("{name}: no files in this test"));
        super::compile_with(
            rules.to_string().as_bytes(),
            "rules.json",
            Default::default(),
            &no_files,
            managed,
        )
    }

    /// The error compiling `rules`, which must fail.
    pub fn err(rules: &Value) -> crate::RulesError {
        match crate::compile(rules.to_string().as_bytes(), "rules.json", Default::default()) {
            Ok(_) => panic!("compiled: {rules}"),
            Err(e) => {
                assert_eq!(e.file, "rules.json", "{e}");
                e
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{base, ok};

    #[test]
    fn the_base_rules_compile() {
        let snap = ok(&base());
        assert_eq!(
            (snap.upstreams.len(), snap.limits.len(), snap.routes.len()),
            (1, 1, 1)
        );
    }

    /// A request takes the first route that matches, so the longer prefix must come first
    /// whatever order the file lists them in.
    #[test]
    fn routes_are_tried_longest_prefix_first() {
        let mut rules = base();
        rules["routes"] = serde_json::json!([
            {"method": "GET", "path": "/v1", "upstream": "u"},
            {"method": "GET", "path": "/v1/orders", "upstream": "u"}
        ]);
        let snap = ok(&rules);
        let prefixes: Vec<&str> = snap.routes.iter().map(|r| &*r.prefix).collect();
        assert_eq!(prefixes, ["/v1/orders", "/v1"]);
    }
}
