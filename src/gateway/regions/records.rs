//! What a Region's agent writes: its record, the same in every Region's store, and its own
//! state, kept only in its Region's store for the agent after it. Both are JSON.

use std::collections::BTreeMap;

use fred::interfaces::{HashesInterface, KeysInterface};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tollgate_regions::{Agent, ShareRecord};

use super::{Regions, timeout};

/// One Region's record: per shared bucket, what `tollgate_regions::Agent` published, plus who
/// wrote it and when.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct RegionRecord {
    pub region: String,
    /// Rises at every rebalance of this Region, whichever gateway is its agent.
    pub seq: u64,
    /// The agent that wrote it.
    pub agent: String,
    /// Its writer's wall clock, in Unix milliseconds.
    pub at_ms: u64,
    pub limits: BTreeMap<String, ShareRecord>,
    /// Per bucket, the room this Region took from silent Regions: a Region that comes back and
    /// finds its share reclaimed starts from nothing.
    #[serde(default)]
    pub reclaimed: BTreeMap<String, BTreeMap<String, f64>>,
}

/// Everything an agent needs to go on where the last one stopped.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct AgentState {
    pub seq: u64,
    /// When the demand totals were last read, in Unix milliseconds.
    pub at_ms: u64,
    /// Per bucket: the running demand total at that read.
    pub demand_seen: BTreeMap<String, u64>,
    /// Per bucket: the demand measured then, per second.
    pub demand: BTreeMap<String, f64>,
    pub agents: BTreeMap<String, Agent>,
}

impl AgentState {
    pub(crate) fn parse(text: Option<String>) -> Result<Option<AgentState>, String> {
        text.map(|t| serde_json::from_str(&t).map_err(|e| format!("the Regions' agent state: {e}")))
            .transpose()
    }
}

/// Every Region's last record as this Region's store holds them; one that can't be read is
/// left out and logged, never guessed.
pub(crate) async fn read_all(regions: &Regions) -> Result<BTreeMap<String, RegionRecord>, String> {
    let names: Vec<&String> = regions.cfg.stores.keys().collect();
    let ks: Vec<String> = names.iter().map(|r| regions.keys.record(r)).collect();
    let texts: Vec<Option<String>> = timeout(regions.own.mget(ks)).await?;
    let mut out = BTreeMap::new();
    for (name, text) in names.into_iter().zip(texts) {
        let Some(text) = text else { continue };
        match serde_json::from_str::<RegionRecord>(&text) {
            Ok(r) if &r.region == name => {
                out.insert(name.clone(), r);
            }
            Ok(r) => {
                tracing::warn!(key = %regions.keys.record(name), holds = %r.region, "a Region's record names another Region; ignored")
            }
            Err(e) => {
                tracing::warn!(key = %regions.keys.record(name), error = %e, "a Region's record is not valid JSON; ignored")
            }
        }
    }
    Ok(out)
}

/// `GET /admin/regions`.
pub(crate) async fn describe(regions: &Regions, now_ms: u64) -> Value {
    let cfg = &regions.cfg;
    let agent: Result<Option<String>, String> = timeout(regions.own.get(regions.keys.agent())).await;
    let records = read_all(regions).await;
    let state: Result<Option<String>, String> = timeout(regions.own.get(regions.keys.state())).await;
    let shares: Result<BTreeMap<String, String>, String> =
        timeout(regions.own.hgetall(regions.keys.shares())).await;
    let mut errors = Vec::new();

    let regions_json: serde_json::Map<String, Value> = match &records {
        Ok(rs) => rs
            .iter()
            .map(|(name, r)| {
                let limits: serde_json::Map<String, Value> = r
                    .limits
                    .iter()
                    .map(|(bucket, rec)| {
                        (
                            bucket.clone(),
                            json!({"demand": rec.demand, "share": rec.share, "unmet": rec.unmet, "granted": rec.granted}),
                        )
                    })
                    .collect();
                (
                    name.clone(),
                    json!({"seq": r.seq, "age_ms": now_ms.saturating_sub(r.at_ms), "agent": r.agent, "limits": limits}),
                )
            })
            .collect(),
        Err(e) => {
            errors.push(format!("records: {e}"));
            serde_json::Map::new()
        }
    };
    let state = match state.and_then(AgentState::parse) {
        Ok(s) => s.unwrap_or_default(),
        Err(e) => {
            errors.push(format!("state: {e}"));
            AgentState::default()
        }
    };
    let shares = shares.unwrap_or_else(|e| {
        errors.push(format!("shares: {e}"));
        BTreeMap::new()
    });
    let buckets = regions.buckets.load();
    let limits: serde_json::Map<String, Value> = buckets
        .list
        .iter()
        .map(|bucket| {
            let a = state.agents.get(&bucket.name);
            let enforced = bucket.params.load().as_deref().map(
                |p| json!({"rate": p.rate.tokens as f64 * 1e6 / p.rate.period_us as f64, "burst": p.burst}),
            );
            let reclaimed: BTreeMap<&str, f64> = a.map(|a| a.reclaimed().collect()).unwrap_or_default();
            (
                bucket.name.clone(),
                json!({
                    "limit": bucket.limit,
                    "share": shares.get(&bucket.name).and_then(|s| s.parse::<f64>().ok()),
                    "pool": a.map_or(0.0, Agent::pool),
                    "target": a.map(Agent::target),
                    "reclaimed": reclaimed,
                    "enforced": enforced,
                }),
            )
        })
        .collect();
    let others = cfg.stores.keys().filter(|r| **r != cfg.region);
    let agent = agent.unwrap_or_else(|e| {
        errors.push(format!("agent lock: {e}"));
        None
    });
    json!({
        "region": cfg.region,
        "this_gateway": cfg.holder,
        "agent": agent,
        "is_agent": regions.is_agent.load(std::sync::atomic::Ordering::Relaxed),
        "interval_ms": cfg.interval.as_millis() as u64,
        "lease_ms": cfg.lease.as_millis() as u64,
        "health": regions.health.describe(others),
        "regions": regions_json,
        "limits": limits,
        "errors": errors,
    })
}
