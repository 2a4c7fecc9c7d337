//! One limit across Regions, live: which buckets are shared (`"scope": "global"` key limits),
//! the share each Region's gateways enforce for them, the demand they report, and the pieces
//! that move shares: the elected agent (`leader`), the outside health checks (`health`) and the
//! records in every Region's store (`records`). The decisions are `tollgate_regions::Agent`'s,
//! the same code the model runs.

mod health;
pub mod home;
mod leader;
mod records;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use fred::clients::Client;
use fred::interfaces::{ClientLike, HashesInterface};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use tollgate_limit::batch::Batch;
use tollgate_limit::bucket::{BucketParams, Rate};
use tollgate_rules::{Scope, Snapshot};
use tollgate_store::redis::{Access, side_client};

pub(crate) use health::Health;

/// The keys every Region's store holds for the shared limits: `tollgate:regions:…` on one
/// node, `tollgate:{regions}:…` on a cluster, so the agent's commit and the read of every
/// record, each one call over several keys, reach one slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RegionKeys {
    prefix: &'static str,
}

impl RegionKeys {
    /// The names in the store at `url`.
    pub(crate) fn of(url: &str) -> RegionKeys {
        let cluster = url.starts_with("redis-cluster://") || url.starts_with("rediss-cluster://");
        RegionKeys {
            prefix: if cluster {
                "tollgate:{regions}:"
            } else {
                "tollgate:regions:"
            },
        }
    }

    /// The agent lock: the holder's name, with a lease.
    pub(crate) fn agent(&self) -> String {
        format!("{}agent", self.prefix)
    }

    /// The agent's whole state, so a new agent goes on where the last one stopped.
    pub(crate) fn state(&self) -> String {
        format!("{}state", self.prefix)
    }

    /// A shared bucket's name → the share this Region's gateways enforce.
    pub(crate) fn shares(&self) -> String {
        format!("{}shares", self.prefix)
    }

    /// A shared bucket's name → running total of requests this Region's gateways received.
    pub(crate) fn demand(&self) -> String {
        format!("{}demand", self.prefix)
    }

    /// A Region's last record, in every Region's store.
    pub(crate) fn record(&self, region: &str) -> String {
        format!("{}record:{region}", self.prefix)
    }
}

/// How a gateway takes part in sharing limits across Regions.
#[derive(Debug, Clone)]
pub struct RegionsConfig {
    /// This gateway's Region.
    pub region: String,
    /// Every Region's store, this one's included.
    pub stores: BTreeMap<String, String>,
    /// The outside health check of other Regions, by name.
    pub health: BTreeMap<String, String>,
    pub interval: Duration,
    /// The agent lock's lease.
    pub lease: Duration,
    /// This gateway's name as agent: its instance name and a boot id.
    pub holder: String,
    /// How long a check in another Region's store may take (security limits' home Regions).
    pub store_timeout: Duration,
}

fn region_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// `NAME=VALUE` pairs of a list flag, each name given once.
fn pairs(flag: &str, items: &[String]) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    // The flag is split at commas, and so is a cluster's or a sentinel URL's list of nodes:
    // an item without `NAME=` goes on with the URL before it.
    let mut joined: Vec<String> = Vec::with_capacity(items.len());
    for item in items {
        match joined.last_mut() {
            Some(last)
                if !item.contains('=') && (last.contains("-cluster://") || last.contains("-sentinel://")) =>
            {
                last.push(',');
                last.push_str(item);
            }
            _ => joined.push(item.clone()),
        }
    }
    for item in &joined {
        let Some((name, value)) = item.split_once('=') else {
            return Err(format!("{flag} {item:?}: expected NAME=URL"));
        };
        let (name, value) = (name.trim(), value.trim());
        if !region_name_ok(name) {
            return Err(format!(
                "{flag} {item:?}: {name:?} is not a Region name (letters, digits, - and _)"
            ));
        }
        if out.insert(name.to_string(), value.to_string()).is_some() {
            return Err(format!("{flag}: Region {name:?} is named twice"));
        }
    }
    Ok(out)
}

impl RegionsConfig {
    /// Checks the flags together: this Region among `--regions`, one plain Redis URL per Region,
    /// health URLs only for other known Regions, and a lease longer than a renewal.
    pub fn parse(
        region: &str,
        regions: &[String],
        health: &[String],
        interval: Duration,
        lease: Duration,
        instance: &str,
    ) -> Result<RegionsConfig, String> {
        let stores = pairs("--regions", regions)?;
        if !stores.contains_key(region) {
            return Err(format!(
                "--region {region:?} is not among --regions ({})",
                stores.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
        if stores.len() < 2 {
            return Err("--regions: name at least two Regions, this one's store first".into());
        }
        for (name, url) in &stores {
            match crate::store_url::StoreUrl::parse(url) {
                Ok(crate::store_url::StoreUrl::Memory) | Err(_) => {
                    return Err(format!(
                        "--regions {name}={url}: each Region's store is Redis: redis://HOST:PORT, redis-cluster://H1:P1,H2:P2 or redis-sentinel://S1:P1/SERVICE (rediss… over TLS)"
                    ));
                }
                Ok(_) => {}
            }
        }
        let health = pairs("--region-health", health)?;
        for (name, url) in &health {
            if !stores.contains_key(name) {
                return Err(format!(
                    "--region-health {name}={url}: {name:?} is not among --regions"
                ));
            }
            if name == region {
                return Err(format!(
                    "--region-health {name}={url}: a Region does not check its own health"
                ));
            }
            health::parse_url(url).map_err(|e| format!("--region-health {name}={url}: {e}"))?;
        }
        if lease < interval.min(Duration::from_millis(30)) * 3 || lease.is_zero() {
            return Err(format!(
                "--region-lease {lease:?}: too short to renew; give it at least three times 30 ms"
            ));
        }
        Ok(RegionsConfig {
            region: region.to_string(),
            stores,
            health,
            interval,
            lease,
            holder: format!("{instance}/{:08x}", rand::random::<u32>()),
            store_timeout: Duration::from_millis(100),
        })
    }

    /// This Region's own store.
    pub fn own_store(&self) -> &str {
        &self.stores[&self.region]
    }
}

/// One shared bucket: a global limit of one key.
pub(crate) struct SharedBucket {
    /// `LIMIT/KEYID`, its name in records and in the store.
    pub name: String,
    /// The limit all Regions share, per second.
    pub limit: f64,
    /// Requests received since the last report to the store.
    demand: AtomicU64,
    /// The numbers this Region enforces now.
    params: ArcSwapOption<BucketParams>,
}

/// The shared buckets of one rules snapshot.
#[derive(Default)]
pub(crate) struct SharedBuckets {
    /// The snapshot they were built from (its serial: the admin API's keys change it too).
    serial: u64,
    by_key: HashMap<(Arc<str>, Arc<str>), usize>,
    pub list: Vec<SharedBucket>,
}

impl SharedBuckets {
    fn build(snap: &Snapshot, regions: usize, shares: &HashMap<String, f64>) -> SharedBuckets {
        let mut buckets = SharedBuckets {
            serial: snap.serial,
            ..SharedBuckets::default()
        };
        for (li, limit) in snap.limits.iter().enumerate() {
            if limit.scope != Scope::Global {
                continue;
            }
            for (k, key) in snap.keys.iter().enumerate() {
                let Some(numbers) = snap.keys.numbers(k, limit, li) else {
                    continue;
                };
                let rate = numbers.params.rate;
                let per_second = rate.tokens as f64 * 1e6 / rate.period_us as f64;
                let name = format!("{}/{}", limit.name, key.id);
                // Until this Region's agent publishes a share, an even split keeps the sum at
                // the limit.
                let share = shares.get(&name).copied().unwrap_or(per_second / regions as f64);
                buckets
                    .by_key
                    .insert((limit.name.clone(), key.id.clone()), buckets.list.len());
                buckets.list.push(SharedBucket {
                    name,
                    limit: per_second,
                    demand: AtomicU64::new(0),
                    params: ArcSwapOption::from_pointee(share_params(share)),
                });
            }
        }
        buckets
    }

    fn same_rules(&self, snap: &Snapshot) -> bool {
        self.serial == snap.serial
    }
}

/// The bucket numbers of a share: its rate per second, and a burst of two seconds of it. A
/// share of nothing still needs a rate, so it gets one request an hour.
pub(crate) fn share_params(share: f64) -> Option<BucketParams> {
    let share = if share.is_finite() { share.max(0.0) } else { 0.0 };
    let (rate, burst) = if share >= 1.0 {
        (
            Rate {
                tokens: share.round() as u64,
                period_us: 1_000_000,
            },
            (2.0 * share).round() as u64,
        )
    } else if share > 0.0 {
        (
            Rate {
                tokens: 1,
                period_us: (1e6 / share).ceil() as u64,
            },
            1,
        )
    } else {
        (
            Rate {
                tokens: 1,
                period_us: 3_600_000_000,
            },
            1,
        )
    };
    BucketParams::new(rate, burst.max(1)).ok()
}

/// A gateway's part in the shared limits: what its requests read and count, and the clients of
/// every Region's store its tasks use.
pub struct Regions {
    pub cfg: RegionsConfig,
    pub(crate) buckets: ArcSwap<SharedBuckets>,
    /// This Region's store.
    pub(crate) own: Client,
    /// The names of the shared limits' keys in this Region's store.
    pub(crate) keys: RegionKeys,
    /// The same in each Region's store, by name.
    pub(crate) store_keys: BTreeMap<String, RegionKeys>,
    /// Every Region's store, by name (this Region's too).
    pub(crate) stores: BTreeMap<String, Client>,
    pub(crate) health: Arc<Health>,
    /// Whether this gateway is its Region's agent now.
    pub(crate) is_agent: std::sync::atomic::AtomicBool,
    /// Per other Region: whether a record is on its way there.
    pub(crate) writing: BTreeMap<String, Arc<std::sync::atomic::AtomicBool>>,
}

impl Regions {
    /// Clients for every Region's store; they connect in the background, so a Region that is
    /// down now only delays its records.
    pub fn connect(cfg: RegionsConfig) -> Result<Arc<Regions>, String> {
        let mut stores = BTreeMap::new();
        for (name, url) in &cfg.stores {
            let place = crate::store_url::StoreUrl::parse(url)?;
            let target = place
                .target(Access::none())
                .ok_or_else(|| format!("Region {name} ({url}): not a Redis store"))?;
            let client = side_client(target).map_err(|e| format!("Region {name} ({url}): {e}"))?;
            let _task = client.connect();
            stores.insert(name.clone(), client);
        }
        let own = stores[&cfg.region].clone();
        let store_keys: BTreeMap<String, RegionKeys> = cfg
            .stores
            .iter()
            .map(|(n, u)| (n.clone(), RegionKeys::of(u)))
            .collect();
        let keys = store_keys[&cfg.region];
        let writing = stores.keys().map(|r| (r.clone(), Arc::default())).collect();
        let health = Arc::new(Health::new(&cfg.health));
        Ok(Arc::new(Regions {
            cfg,
            buckets: ArcSwap::from_pointee(SharedBuckets::default()),
            own,
            keys,
            store_keys,
            stores,
            health,
            is_agent: std::sync::atomic::AtomicBool::new(false),
            writing,
        }))
    }

    /// Counts the request toward its Region's demand and puts this Region's share in place of
    /// each global limit's numbers. A request refused later still counted: demand is what
    /// arrived, so a share that is too small shows.
    pub fn apply(&self, snap: &Snapshot, key: Option<usize>, batch: &mut Batch) {
        let Some(k) = key else { return };
        let buckets = self.buckets.load();
        if !buckets.same_rules(snap) {
            // New rules: the refresher rebuilds the buckets within a tick; until then the limit's
            // own numbers hold, as on a gateway without Regions.
            return;
        }
        for item in batch.iter_mut() {
            let limit = &snap.limits[item.limit as usize];
            if limit.scope != Scope::Global {
                continue;
            }
            let Some(&i) = buckets.by_key.get(&(limit.name.clone(), snap.keys[k].id.clone())) else {
                continue;
            };
            let bucket = &buckets.list[i];
            // A peek (cost 0, the usage route's read) is no demand: the share it reads is the
            // one the Region enforces.
            if item.charge.cost > 0 {
                bucket.demand.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(p) = bucket.params.load().as_deref() {
                item.charge.params = *p;
            }
        }
    }

    /// Rebuilds the buckets when the rules changed, reports the demand counted since the last
    /// call, and takes the shares this Region's agent published.
    async fn refresh(&self, snap: &Snapshot) -> Result<(), String> {
        let shares: HashMap<String, String> = timeout(self.own.hgetall(self.keys.shares())).await?;
        let shares: HashMap<String, f64> = shares
            .into_iter()
            .filter_map(|(k, v)| v.parse().ok().map(|v| (k, v)))
            .collect();
        let current = self.buckets.load_full();
        if !current.same_rules(snap) {
            self.buckets.store(Arc::new(SharedBuckets::build(
                snap,
                self.cfg.stores.len(),
                &shares,
            )));
        } else {
            for bucket in &current.list {
                if let Some(&s) = shares.get(&bucket.name) {
                    bucket.params.store(share_params(s).map(Arc::new));
                }
            }
        }
        // Counts from buckets just replaced are reported too: a reload loses no demand.
        let mut counts: Vec<(String, u64)> = Vec::new();
        for bucket in &current.list {
            let n = bucket.demand.swap(0, Ordering::Relaxed);
            if n > 0 {
                counts.push((bucket.name.clone(), n));
            }
        }
        for (i, (name, n)) in counts.iter().enumerate() {
            let r: Result<i64, String> = timeout(self.own.hincrby(self.keys.demand(), name, *n as i64)).await;
            if let Err(e) = r {
                // Put back what could not be written, so the next report carries it.
                let buckets = self.buckets.load();
                for (name, n) in &counts[i..] {
                    if let Some(s) = buckets.list.iter().find(|s| &s.name == name) {
                        s.demand.fetch_add(*n, Ordering::Relaxed);
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// The Regions' state as `/admin/regions` shows it.
    pub async fn describe(&self, now_ms: u64) -> serde_json::Value {
        records::describe(self, now_ms).await
    }
}

/// How long one store command of the Regions' work may take: a Region that does not answer
/// must not hold up the others.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(1);

pub(crate) async fn timeout<T>(
    f: impl std::future::Future<Output = Result<T, fred::error::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(IO_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.details().to_string()),
        Err(_) => Err("no answer within 1 s".into()),
    }
}

/// The running Regions tasks of one gateway.
pub(crate) struct RegionTasks {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl RegionTasks {
    /// Stops the tasks; an agent gives up its lock so the next one need not wait for the lease.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Starts the refresher (every gateway), the health checks and the agent (elected).
pub(crate) fn start(regions: Arc<Regions>, rules: Arc<ArcSwap<Snapshot>>) -> RegionTasks {
    let (stop, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    // Four reports a rebalance, so the agent's demand is never more than a quarter late.
    let tick = (regions.cfg.interval / 4).max(Duration::from_millis(10));
    {
        let (regions, rules, mut stop_rx) = (regions.clone(), rules.clone(), stop_rx.clone());
        tasks.push(tokio::spawn(async move {
            let mut every = tokio::time::interval(tick);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut warned = false;
            loop {
                tokio::select! {
                    _ = every.tick() => {}
                    _ = stop_rx.changed() => return,
                }
                match regions.refresh(&rules.load()).await {
                    Ok(()) => warned = false,
                    Err(e) if !warned => {
                        warned = true;
                        tracing::warn!(error = %e, region = %regions.cfg.region, "cannot reach this Region's store: the last shares hold");
                    }
                    Err(_) => {}
                }
            }
        }));
    }
    tasks.push(tokio::spawn(health::run(
        regions.health.clone(),
        regions.cfg.interval,
        stop_rx.clone(),
    )));
    tasks.push(tokio::spawn(leader::run(regions, rules, stop_rx)));
    RegionTasks { stop, tasks }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_checked_together() {
        let ok = RegionsConfig::parse(
            "A",
            &["A=redis://a:1".into(), "B=redis://b:1".into()],
            &["B=http://127.0.0.1:9/healthz".into()],
            Duration::from_secs(5),
            Duration::from_secs(10),
            "gw",
        )
        .unwrap();
        assert_eq!(ok.own_store(), "redis://a:1");
        let err = |region: &str, regions: &[&str], health: &[&str]| {
            RegionsConfig::parse(
                region,
                &regions.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                &health.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                Duration::from_secs(5),
                Duration::from_secs(10),
                "gw",
            )
            .unwrap_err()
        };
        assert!(err("C", &["A=redis://a:1", "B=redis://b:1"], &[]).contains("not among"));
        assert!(err("A", &["A=redis://a:1", "A=redis://b:1"], &[]).contains("twice"));
        assert!(err("A", &["A=memory", "B=redis://b:1"], &[]).contains("redis://"));
        assert!(err("A", &["A=redis://a:1", "B=redis://b:1"], &["A=http://x:1/"]).contains("own health"));
        assert!(err("A", &["A=redis://a:1", "B=redis://b:1"], &["C=http://x:1/"]).contains("not among"));
        assert!(err("A", &["A=redis://a:1", "B=redis://b:1"], &["B=ftp://x/"]).contains("http://"));
        assert!(err("A", &["A=redis://a:1"], &[]).contains("at least two"));
    }

    /// The usage route reads a key's global buckets with checks of cost 0 beside what it
    /// charges: those read the Region's share, and count no demand.
    #[tokio::test]
    async fn a_check_of_cost_zero_reads_the_share_and_counts_no_demand() {
        let snap = tollgate_rules::compile(
            br#"{"version": 1, "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
                "limits": {"plan": {"dimension": "key", "rate": "100/1s", "burst": 100, "scope": "global"}},
                "keys": [{"id": "k", "sha256": "80eb978e9718fd80febfebcc532e51df464a198ba85d15a9b9b6fb31acc1b3bc"}],
                "routes": [{"method": "GET", "path": "/", "upstream": "u", "cost": {"plan": 1}}]}"#,
            "test.json",
            tollgate_rules::CompileOptions::default(),
        )
        .unwrap();
        let cfg = RegionsConfig::parse(
            "A",
            &["A=redis://127.0.0.1:9".into(), "B=redis://127.0.0.1:9".into()],
            &[],
            Duration::from_secs(5),
            Duration::from_secs(10),
            "gw",
        )
        .unwrap();
        let regions = Regions::connect(cfg).unwrap();
        regions
            .buckets
            .store(Arc::new(SharedBuckets::build(&snap, 2, &HashMap::new())));
        let route = &snap.routes[0];
        let ip = std::net::IpAddr::from([127, 0, 0, 1]);
        let batch = || {
            tollgate_rules::plan::build(
                &snap,
                route,
                Some(0),
                ip,
                Default::default(),
                &Default::default(),
                None,
            )
            .unwrap()
        };
        let mut charged = batch();
        let mut peek = batch();
        peek[0].charge.cost = 0;
        regions.apply(&snap, Some(0), &mut charged);
        regions.apply(&snap, Some(0), &mut peek);
        let half = share_params(50.0).unwrap();
        assert_eq!((charged[0].charge.params, peek[0].charge.params), (half, half));
        let demand = regions.buckets.load().list[0].demand.load(Ordering::Relaxed);
        assert_eq!(demand, 1, "only the charged check is demand");
    }

    #[test]
    fn a_share_becomes_a_rate_with_two_seconds_of_burst() {
        let p = share_params(3_333.4).unwrap();
        assert_eq!(
            (p.rate.tokens, p.rate.period_us, p.burst),
            (3_333, 1_000_000, 6_667)
        );
        let small = share_params(0.5).unwrap();
        assert_eq!(
            (small.rate.tokens, small.rate.period_us, small.burst),
            (1, 2_000_000, 1)
        );
        let none = share_params(0.0).unwrap();
        assert_eq!((none.rate.period_us, none.burst), (3_600_000_000, 1));
    }
}
