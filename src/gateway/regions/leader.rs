//! The Region's agent: one gateway per Region, elected through a lock with a lease in its own
//! store. At every rebalance it measures the Region's demand, reads the other Regions' records,
//! lets `tollgate_regions::Agent` decide, and writes the outcome: state, shares and record to
//! its own store in one script that first checks it still holds the lock, then the record to
//! every other Region's store.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use fred::interfaces::{HashesInterface, KeysInterface, LuaInterface};
use fred::types::{Expiration, SetOptions};
use tokio::sync::watch;
use tollgate_regions::{Agent, Design, Params, ReclaimRule, View};
use tollgate_rules::Snapshot;

use super::records::{AgentState, RegionRecord, read_all};
use super::{Regions, timeout};

/// Extends the lease only for its holder.
const RENEW: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0";
/// Gives the lock up only for its holder.
const RELEASE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";
/// Writes state, shares and this Region's record at once, and only while the writer holds the
/// lock: an agent whose lease ran out while it decided must not overwrite its successor.
const COMMIT: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3])
redis.call('DEL', KEYS[4])
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]) end
return 1
"#;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What the gateway holds while it is the agent.
struct Held {
    state: AgentState,
    /// Whether the demand totals have a baseline to measure from.
    measured: bool,
}

/// Takes part in the election and, while elected, rebalances every interval; gives the lock
/// up when stopped.
pub(crate) async fn run(
    regions: Arc<Regions>,
    rules: Arc<ArcSwap<Snapshot>>,
    mut stop: watch::Receiver<bool>,
) {
    let cfg = &regions.cfg;
    let tick = (cfg.interval / 4)
        .min(cfg.lease / 3)
        .max(Duration::from_millis(10));
    let mut every = tokio::time::interval(tick);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut held: Option<Held> = None;
    let mut last_error: Option<String> = None;
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stop.changed() => break,
        }
        let result = step(&regions, &rules, &mut held, tick).await;
        regions.is_agent.store(held.is_some(), Ordering::Relaxed);
        match result {
            Ok(()) => last_error = None,
            Err(e) => {
                if last_error.as_ref() != Some(&e) {
                    tracing::warn!(region = %cfg.region, error = %e, "Regions agent");
                }
                last_error = Some(e);
            }
        }
    }
    if held.is_some() {
        let released: Result<i64, String> = timeout(regions.own.eval(
            RELEASE,
            vec![regions.keys.agent()],
            vec![cfg.holder.clone()],
        ))
        .await;
        if released.is_ok() {
            tracing::info!(region = %cfg.region, holder = %cfg.holder, "gave up the Regions agent lock");
        }
        regions.is_agent.store(false, Ordering::Relaxed);
    }
}

async fn step(
    regions: &Regions,
    rules: &ArcSwap<Snapshot>,
    held: &mut Option<Held>,
    tick: Duration,
) -> Result<(), String> {
    let cfg = &regions.cfg;
    let lease_ms = cfg.lease.as_millis() as i64;
    match held {
        None => {
            let won: Option<String> = timeout(regions.own.set(
                regions.keys.agent(),
                cfg.holder.clone(),
                Some(Expiration::PX(lease_ms)),
                Some(SetOptions::NX),
                false,
            ))
            .await?;
            if won.is_none() {
                return Ok(());
            }
            let text: Option<String> = timeout(regions.own.get(regions.keys.state())).await?;
            let state = match AgentState::parse(text) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "the last agent's state can't be read; starting afresh");
                    None
                }
            };
            tracing::info!(
                region = %cfg.region,
                holder = %cfg.holder,
                went_on_from = state.as_ref().map(|s| s.seq),
                "elected the Region's agent"
            );
            *held = Some(match state {
                Some(state) => Held {
                    state,
                    measured: true,
                },
                None => Held {
                    state: AgentState::default(),
                    measured: false,
                },
            });
        }
        Some(_) => {
            let kept: i64 = match timeout(regions.own.eval(
                RENEW,
                vec![regions.keys.agent()],
                vec![cfg.holder.clone(), lease_ms.to_string()],
            ))
            .await
            {
                Ok(k) => k,
                Err(e) => {
                    *held = None;
                    return Err(format!("can't renew the agent lock, stepping down: {e}"));
                }
            };
            if kept != 1 {
                *held = None;
                tracing::warn!(region = %cfg.region, "the agent lock passed to another gateway; stepping down");
                return Ok(());
            }
        }
    }
    let Some(h) = held.as_mut() else { return Ok(()) };
    let now = now_ms();
    let due = cfg.interval.as_millis() as u64;
    if h.measured && now.saturating_sub(h.state.at_ms) + (tick.as_millis() as u64) / 2 < due {
        return Ok(());
    }
    let snap = rules.load();
    match rebalance(regions, &snap, h, now).await {
        Ok(true) => Ok(()),
        Ok(false) => {
            *held = None;
            tracing::warn!(region = %cfg.region, "lost the agent lock while rebalancing; nothing was written");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// One rebalance; `false` when the lock was no longer this gateway's.
async fn rebalance(regions: &Regions, _snap: &Snapshot, h: &mut Held, now: u64) -> Result<bool, String> {
    let cfg = &regions.cfg;
    let totals: HashMap<String, String> = timeout(regions.own.hgetall(regions.keys.demand())).await?;
    let total_of = |bucket: &str| {
        totals
            .get(bucket)
            .and_then(|t| t.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let buckets = regions.buckets.load_full();
    if !h.measured {
        // A first agent has no earlier reading to measure demand from: it takes one now and
        // decides at the next rebalance, rather than deciding on a demand of nothing.
        for bucket in &buckets.list {
            h.state
                .demand_seen
                .insert(bucket.name.clone(), total_of(&bucket.name));
        }
        h.state.at_ms = now;
        h.measured = true;
        return Ok(true);
    }
    let records = read_all(regions).await?;
    let others: Vec<&RegionRecord> = records.values().filter(|r| r.region != cfg.region).collect();
    let down = regions.health.down();
    let elapsed_s = now.saturating_sub(h.state.at_ms) as f64 / 1000.0;

    let mut next = h.state.clone();
    next.seq += 1;
    next.at_ms = now;
    let mut out = RegionRecord {
        region: cfg.region.clone(),
        seq: next.seq,
        agent: cfg.holder.clone(),
        at_ms: now,
        limits: BTreeMap::new(),
        reclaimed: BTreeMap::new(),
    };
    let mut shares: Vec<String> = Vec::new();
    for bucket in &buckets.list {
        let total = total_of(&bucket.name);
        let demand = match next.demand_seen.get(&bucket.name) {
            Some(&seen) if elapsed_s > 0.0 => total.saturating_sub(seen) as f64 / elapsed_s,
            _ => next.demand.get(&bucket.name).copied().unwrap_or(0.0),
        };
        next.demand_seen.insert(bucket.name.clone(), total);
        next.demand.insert(bucket.name.clone(), demand);
        let seen: Vec<tollgate_regions::ShareRecord> = others
            .iter()
            .filter_map(|r| r.limits.get(&bucket.name).cloned())
            .collect();
        let agent = next
            .agents
            .entry(bucket.name.clone())
            .or_insert_with(|| first_agent(cfg, &bucket.name, bucket.limit, &others));
        let record = agent.rebalance(
            &Params::for_limit(bucket.limit),
            Design::NamedGrants,
            ReclaimRule::TwoSignals,
            View {
                own_demand: demand,
                records: &seen,
                unhealthy: &down,
            },
        );
        let reclaimed: BTreeMap<String, f64> = agent.reclaimed().map(|(r, a)| (r.to_string(), a)).collect();
        if !reclaimed.is_empty() {
            out.reclaimed.insert(bucket.name.clone(), reclaimed);
        }
        out.limits.insert(bucket.name.clone(), record);
        shares.push(bucket.name.clone());
        shares.push(agent.share().to_string());
    }
    let record = serde_json::to_string(&out).map_err(|e| e.to_string())?;
    let state = serde_json::to_string(&next).map_err(|e| e.to_string())?;
    let mut args = vec![cfg.holder.clone(), state, record.clone()];
    args.extend(shares);
    let own_key = regions.keys.record(&cfg.region);
    let committed: i64 = timeout(regions.own.eval(
        COMMIT,
        vec![
            regions.keys.agent(),
            regions.keys.state(),
            own_key.clone(),
            regions.keys.shares(),
        ],
        args,
    ))
    .await?;
    if committed != 1 {
        return Ok(false);
    }
    h.state = next;
    // The others' stores in the background: a Region that doesn't answer must delay neither
    // this agent's next rebalance nor its lock's renewal. One write per Region at a time; a
    // record is whole, so one skipped behind a slow write is made good by the next.
    for (name, client) in regions.stores.iter().filter(|(n, _)| **n != cfg.region) {
        let Some(busy) = regions.writing.get(name) else {
            continue;
        };
        if busy.swap(true, Ordering::AcqRel) {
            continue;
        }
        // Under the names that Region's store uses (a cluster's carry a hash tag).
        let key = regions
            .store_keys
            .get(name)
            .map_or_else(|| own_key.clone(), |k| k.record(&cfg.region));
        let (name, client, record, busy) = (name.clone(), client.clone(), record.clone(), busy.clone());
        tokio::spawn(async move {
            let r: Result<(), String> = timeout(client.set(key, record, None, None, false)).await;
            if let Err(e) = r {
                tracing::debug!(to = %name, error = %e, "this Region's record did not reach a Region");
            }
            busy.store(false, Ordering::Release);
        });
    }
    Ok(true)
}

/// The agent of a bucket this Region has no state for: an even split at a first start, or
/// nothing when another Region's record shows it reclaimed this Region's share (this Region
/// is coming back, and must be granted room by name).
fn first_agent(cfg: &super::RegionsConfig, bucket: &str, limit: f64, others: &[&RegionRecord]) -> Agent {
    let reclaimed_from_us = others.iter().any(|r| {
        r.reclaimed
            .get(bucket)
            .is_some_and(|m| m.contains_key(&cfg.region))
    });
    if reclaimed_from_us {
        Agent::returning(cfg.region.clone())
    } else {
        Agent::new(cfg.region.clone(), limit / cfg.stores.len() as f64)
    }
}
