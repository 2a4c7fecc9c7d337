//! The rules each run serves: the fleet rules with every upstream pointed at the demo upstream,
//! the variants the modes need (exact shares, a failure policy), and the storm key's contract.

use std::net::SocketAddr;
use std::path::Path;

use serde_json::Value;

use super::args::{Mode, Policy, RunSpec};
use tollgate_limit::bucket::Rate;
use tollgate_rules::{CompileOptions, Snapshot};

/// rules/fleet.json, built in so `tollgate fleet` runs from any directory.
pub(crate) const BUILTIN: &str = include_str!("../../rules/fleet.json");

/// The route every request of the harness takes.
pub const PATH: &str = "/v1/orders";

/// The rules as parsed JSON, edited per run and compiled before any gateway sees them.
pub(crate) struct BaseRules {
    value: Value,
    pub label: String,
}

/// What the storm key may have: `burst + rate·t`, in requests of the storm's route.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Contract {
    pub limit: String,
    pub rate: String,
    pub burst: u64,
    pub cost: u64,
    /// Requests a second the contract allows on the harness's route: r / cost.
    pub per_second: f64,
    #[serde(skip)]
    pub parsed: Rate,
}

impl Contract {
    /// `(b + r·t) / cost` for a span of `span_us` microseconds.
    pub fn bound(&self, span_us: u64) -> f64 {
        let tokens =
            self.burst as f64 + self.parsed.tokens as f64 * span_us as f64 / self.parsed.period_us as f64;
        tokens / self.cost as f64
    }

    pub fn per_second(&self) -> f64 {
        self.parsed.per_second() / self.cost as f64
    }
}

impl BaseRules {
    pub fn load(path: Option<&Path>) -> Result<BaseRules, String> {
        let (text, label) = match path {
            Some(p) => (
                std::fs::read_to_string(p)
                    .map_err(|e| format!("--rules {}: cannot read: {e}", p.display()))?,
                p.display().to_string(),
            ),
            None => (BUILTIN.to_string(), "rules/fleet.json (built in)".to_string()),
        };
        // Compile once as given, so a broken file is reported against its own name.
        tollgate_rules::compile(text.as_bytes(), &label, CompileOptions::default())
            .map_err(|e| e.to_string())?;
        let value: Value = serde_json::from_str(&text).map_err(|e| format!("{label}: not JSON: {e}"))?;
        Ok(BaseRules { value, label })
    }

    /// The rules text for one run, compiled to make sure every gateway will accept it.
    pub fn variant(&self, upstream: SocketAddr, run: RunSpec, n: u32) -> Result<String, String> {
        let mut v = self.value.clone();
        let label = format!("{} ({} variant)", self.label, run.label());
        point_upstreams(&mut v, upstream, &label)?;
        if run.mode == Mode::Shares {
            shares(&mut v, n, &label)?;
        }
        if let Some(p) = run.policy {
            set_policy(&mut v, p);
        }
        let text = serde_json::to_string_pretty(&v).map_err(|e| format!("{label}: {e}"))?;
        tollgate_rules::compile(text.as_bytes(), &label, CompileOptions::default())
            .map_err(|e| e.to_string())?;
        Ok(text)
    }

    pub fn compiled(&self) -> Result<Snapshot, String> {
        let text = serde_json::to_string(&self.value).map_err(|e| e.to_string())?;
        tollgate_rules::compile(text.as_bytes(), &self.label, CompileOptions::default())
            .map_err(|e| e.to_string())
    }
}

fn point_upstreams(v: &mut Value, upstream: SocketAddr, label: &str) -> Result<(), String> {
    let Some(ups) = v.get_mut("upstreams").and_then(Value::as_object_mut) else {
        return Err(format!("{label}: upstreams: missing"));
    };
    for (name, u) in ups.iter_mut() {
        let url = u
            .get("url")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{label}: upstreams.{name}.url: missing"))?;
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("{label}: upstreams.{name}.url {url:?}: {e}"))?;
        let path = uri.path_and_query().map_or("", |p| p.as_str());
        let path = if path == "/" { "" } else { path };
        u["url"] = Value::String(format!("http://{upstream}{path}"));
    }
    Ok(())
}

/// One gateway's exact share of `rate`: the same tokens over N times the period.
pub(crate) fn share_rate(rate: &str, n: u32) -> Result<String, String> {
    let r = Rate::parse(rate)?;
    let period = r
        .period_us
        .checked_mul(u64::from(n))
        .ok_or_else(|| format!("rate {rate:?}: the share's period overflows"))?;
    Ok(format!("{}/{}us", r.tokens, period))
}

pub(crate) fn share_burst(burst: u64, n: u32) -> u64 {
    (burst / u64::from(n)).max(1)
}

/// Divides every limit's numbers, and every key's own numbers, into exact shares.
fn shares(v: &mut Value, n: u32, label: &str) -> Result<(), String> {
    fn divide(nums: &mut Value, n: u32, field: &str) -> Result<(), String> {
        if let Some(rate) = nums.get("rate").and_then(Value::as_str) {
            let shared = share_rate(rate, n).map_err(|e| format!("{field}: {e}"))?;
            nums["rate"] = Value::String(shared);
        }
        if let Some(burst) = nums.get("burst").and_then(Value::as_u64) {
            nums["burst"] = Value::from(share_burst(burst, n));
        }
        Ok(())
    }
    if let Some(limits) = v.get_mut("limits").and_then(Value::as_object_mut) {
        for (name, l) in limits.iter_mut() {
            divide(l, n, &format!("{label}: limits.{name}"))?;
        }
    }
    if let Some(keys) = v.get_mut("keys").and_then(Value::as_array_mut) {
        for (i, k) in keys.iter_mut().enumerate() {
            if let Some(limits) = k.get_mut("limits").and_then(Value::as_object_mut) {
                for (name, nums) in limits.iter_mut() {
                    divide(nums, n, &format!("{label}: keys[{i}].limits.{name}"))?;
                }
            }
        }
    }
    Ok(())
}

/// Security limits may never fail open, so the policy goes on capacity limits only.
fn set_policy(v: &mut Value, p: Policy) {
    if let Some(limits) = v.get_mut("limits").and_then(Value::as_object_mut) {
        for l in limits.values_mut() {
            if l.get("class").and_then(Value::as_str) != Some("security") {
                l["on_store_failure"] = Value::String(p.name().to_string());
            }
        }
    }
}

/// The storm key's contract on the harness's route: of the enforced limits the route charges
/// and the key has numbers for, the one with the lowest long-run rate per request.
pub fn contract(snap: &Snapshot, secret: &str) -> Result<Contract, String> {
    let key = key_index(snap, secret, "--storm-key")?;
    let route = snap.route(&http::Method::GET, PATH).ok_or_else(|| {
        format!(
            "{}: no route for GET {PATH}, which the harness sends",
            snap.source
        )
    })?;
    let k = key;
    let key = &snap.keys[k];
    let mut best: Option<Contract> = None;
    for &(li, cost) in &snap.routes[route].costs {
        let limit = &snap.limits[li as usize];
        if limit.mode != tollgate_rules::Mode::Enforce || cost == 0 {
            continue;
        }
        let Some(nums) = snap.keys.numbers(k, limit, li as usize) else {
            continue;
        };
        let p = &nums.params;
        let c = Contract {
            limit: limit.name.to_string(),
            rate: p.rate.to_string(),
            burst: p.burst,
            cost,
            per_second: p.rate.per_second() / cost as f64,
            parsed: p.rate,
        };
        if best.as_ref().is_none_or(|b| c.per_second() < b.per_second()) {
            best = Some(c);
        }
    }
    best.ok_or_else(|| {
        format!(
            "{}: GET {PATH} charges key {} no enforced limit: there is no contract to measure",
            snap.source, key.id
        )
    })
}

/// The key a secret names, or an error saying which flag named a key the rules lack.
pub fn key_index(snap: &Snapshot, secret: &str, flag: &str) -> Result<usize, String> {
    snap.key_by_hash(&tollgate_rules::hash_secret(secret.as_bytes()))
        .ok_or_else(|| {
            format!(
                "{flag}: {}: no key in the rules has this secret's SHA-256",
                snap.source
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(mode: Mode, policy: Option<Policy>) -> RunSpec {
        RunSpec { mode, policy }
    }

    #[test]
    fn shares_divide_rate_and_burst_exactly() {
        assert_eq!(share_rate("600/60s", 20).unwrap(), "600/1200000000us");
        assert_eq!(share_burst(20, 20), 1);
        assert_eq!(share_burst(500, 20), 25);
        assert_eq!(share_burst(5, 20), 1);
        let base = BaseRules::load(None).unwrap();
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let text = base.variant(addr, run(Mode::Shares, None), 20).unwrap();
        let snap = tollgate_rules::compile(text.as_bytes(), "t", CompileOptions::default()).unwrap();
        let c = contract(&snap, "k7-demo-key").unwrap();
        assert_eq!(c.burst, 1);
        assert!((c.per_second() - 0.5).abs() < 1e-12, "{}", c.per_second());
        assert_eq!(snap.upstreams[0].authority.as_str(), "127.0.0.1:9");
    }

    #[test]
    fn the_contract_of_k7_is_ten_a_second_burst_twenty() {
        let snap = BaseRules::load(None).unwrap().compiled().unwrap();
        let c = contract(&snap, "k7-demo-key").unwrap();
        assert_eq!((c.burst, c.cost, c.limit.as_str()), (20, 1, "plan"));
        assert_eq!(c.bound(120_000_000), 1_220.0);
        assert!(contract(&snap, "nobody").unwrap_err().contains("--storm-key"));
    }

    #[test]
    fn a_policy_variant_sets_every_capacity_limit() {
        let base = BaseRules::load(None).unwrap();
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        for p in [Policy::Open, Policy::Closed, Policy::Local] {
            let text = base.variant(addr, run(Mode::Central, Some(p)), 20).unwrap();
            let snap = tollgate_rules::compile(text.as_bytes(), "t", CompileOptions::default()).unwrap();
            let plan = snap.limits.iter().find(|l| &*l.name == "plan").unwrap();
            let want = match p {
                Policy::Open => tollgate_store::FailurePolicy::Open,
                Policy::Closed => tollgate_store::FailurePolicy::Closed,
                Policy::Local => tollgate_store::FailurePolicy::Local,
            };
            assert_eq!(plan.policy, want);
        }
    }
}
