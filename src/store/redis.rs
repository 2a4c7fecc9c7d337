//! The shared store: every bucket of a request checked by one `EVALSHA` of `lua/check.lua` in
//! Redis or Valkey (one node or a Cluster), on the store's clock.
//!
//! The script is the arithmetic of `limit/bucket.rs`; the gateway sends only numbers (ARGV) and
//! bucket names followed by their pages (KEYS, [`page_of`]) and reads back integers, so both
//! sides agree to the unit. A refund of an undelivered request is one `EVALSHA` of
//! `lua/refund.lua` on the buckets its check charged, sent at once (not through the queue:
//! refunds are rare) and, like every call, at most once.
//!
//! On one node every check waits in one queue, and the checks that queued meanwhile go together
//! in the next call (each still all-or-nothing on its own buckets), with at most
//! [`MAX_IN_FLIGHT`] calls out. (On a cluster a check is sent at once while fewer than
//! [`MAX_IN_FLIGHT_CLUSTER`] calls are out: checks of one hash slot rarely meet.)
//! The queue's task is woken by the first check and runs after the tasks the same readiness
//! woke, so the requests that arrived together share a call even while a call slot is free.
//! fred writes every command with its own socket write, so one call per check cost the gateway
//! about 12 µs of CPU per check on loopback, against 1.4 µs for `redis-benchmark -P 16`, and
//! the store a command dispatch and a script start per check; sharing calls pays those once per
//! call (benches/README.md "Row R").

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fred::bytes_utils::Str;
use fred::prelude::{
    Builder, ClientLike, Config, ConnectionConfig, Error as FredError, ErrorKind, Key, LuaInterface,
    PerformanceConfig, Pool, ReconnectPolicy, Server, ServerConfig, TcpConfig, Value,
};
use fred::types::config::ClusterDiscoveryPolicy;
use fred::util::redis_keyslot;
use smallvec::SmallVec;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::lease::{GiveBackReply, LeaseReply, Lessor, held_key};
use super::nodes::{Nodes, Script};
use super::page::page_of;
use super::{Adjusted, BoxFuture, CheckFuture, CheckItem, Outcome, Source, Store, StoreError, mismatch};
use tollgate_limit::bucket::{BucketParams, BucketVerdict};
use tollgate_limit::clock::Clock;
use tollgate_limit::lease::{Account, Grant, RECORD_TTL_US, Recorded};

/// The check script. Its SHA-1 is what every call sends.
pub const SCRIPT: &str = concat!(
    include_str!("../../lua/bucket.lua"),
    include_str!("../../lua/check.lua")
);

/// The lease script (hot keys): LEASE and GIVE BACK on the same buckets, same encoding.
pub(crate) const LEASE_SCRIPT: &str = concat!(
    include_str!("../../lua/bucket.lua"),
    include_str!("../../lua/lease.lua")
);

/// The refund script: gives back what a check charged, for a request that was not delivered.
pub(crate) const REFUND_SCRIPT: &str = concat!(
    include_str!("../../lua/bucket.lua"),
    include_str!("../../lua/refund.lua")
);

/// ARGV of a bucket sent in full: scale, refill, capacity, need, ttl, flags, debt.
pub(crate) const ARGS_PER_BUCKET: usize = 7;
/// Where the need and the flags are among a bucket's [`ARGS_PER_BUCKET`].
const NEED: usize = 3;
const FLAGS: usize = 5;
/// The flag that tells the script the call names the bucket again (1 is shadow).
const KEEP: i64 = 2;

/// Calls out at once; checks that queue while every slot is taken share the next call. A few
/// keep the connection busy without making a lone check wait for another's round trip.
pub const MAX_IN_FLIGHT: usize = 4;

/// Calls out at once on a Cluster. A script may touch one hash slot only, so checks of
/// different slots can never share a call, and a cap of four would only hold the rate to four
/// round trips at a time (benches/README.md "Redis Cluster: three masters beside one"); checks
/// of one slot still queue and share once this many are out.
pub const MAX_IN_FLIGHT_CLUSTER: usize = 64;

/// The most requests and buckets in one call: a script blocks its node while it runs, so one
/// call stays short (about 3 µs of script per bucket).
const MAX_REQUESTS_PER_CALL: usize = 64;
const MAX_KEYS_PER_CALL: usize = 256;

/// ARGV[1] that tells the script to read the store's TIME.
pub(crate) const STORE_CLOCK: i64 = -1;

/// Connections per node. With at most [`MAX_IN_FLIGHT`] calls out, one is enough: 1 and 2
/// measured the same (benches/README.md).
pub const DEFAULT_CONNECTIONS: usize = 1;

/// How long a new connection may take before start-up gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A bound on one call, so a store that stops answering gives a `StoreError::Timeout` rather
/// than a request that hangs. The failure guard sets the real, much shorter, budget.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the store is.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// `redis://[user:password@]host:port[/db]`.
    Node(&'a str),
    /// `HOST:PORT` of one or more cluster nodes; the rest are discovered.
    Cluster(&'a [String]),
}

impl std::fmt::Display for Target<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Node(url) => f.write_str(url),
            Target::Cluster(nodes) => write!(f, "redis-cluster://{}", nodes.join(",")),
        }
    }
}

/// Why the store can't be used at start-up. Every message names the store.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConnectError {
    #[error("--store {store}: {reason}")]
    BadTarget { store: String, reason: String },
    #[error("cannot connect to the Redis store at {store}: {reason}")]
    Unreachable { store: String, reason: String },
    #[error("the Redis store at {store} refused to load lua/check.lua: {reason}")]
    ScriptLoad { store: String, reason: String },
    #[error(
        "the Redis store at {store} cannot read its clock inside a script (TIME in lua/check.lua failed: {reason}). \
         Tollgate refills buckets on the store's clock so that gateways whose clocks differ cannot hand out extra \
         tokens. Use a store that allows TIME in scripts, or start with --clock gateway (TOLLGATE_CLOCK=gateway) \
         and accept the cost described in the README section \"Redis store\""
    )]
    TimeRefused { store: String, reason: String },
    #[error("the Redis store at {store} ran lua/check.lua but answered {answer}")]
    BadProbe { store: String, answer: String },
}

/// Buckets in Redis, checked by `lua/check.lua`.
pub struct RedisStore {
    shared: Arc<Shared>,
    queue: mpsc::UnboundedSender<Pending>,
    kind: &'static str,
}

/// The connections: one node's, or a cluster's primaries each on its own client.
enum Conn {
    One(Pool),
    Cluster(Arc<Nodes>),
}

impl Conn {
    async fn run(&self, script: Script<'_>, keys: Vec<Key>, args: Vec<Value>) -> Result<Value, FredError> {
        match self {
            Conn::One(pool) => match script {
                Script::Sha(sha) => pool.evalsha(sha, keys, args).await,
                Script::Text(text) => pool.eval(text, keys, args).await,
            },
            Conn::Cluster(nodes) => nodes.run(script, keys, args).await,
        }
    }

    async fn load(&self, script: &str) -> Result<(), FredError> {
        match self {
            Conn::One(pool) => pool.script_load_cluster::<(), _>(script).await,
            Conn::Cluster(nodes) => nodes.load(script).await,
        }
    }

    async fn quit(&self) {
        match self {
            Conn::One(pool) => {
                let _ = pool.quit().await;
            }
            Conn::Cluster(nodes) => nodes.quit().await,
        }
    }
}

/// What the queue's task and the callers share.
struct Shared {
    /// [`DEFAULT_CONNECTIONS`] per node unless told otherwise, used round-robin.
    client: Conn,
    sha: Str,
    lease_sha: Str,
    refund_sha: Str,
    /// `None`: the script reads the store's TIME. `Some`: the gateway's clock (`--clock gateway`).
    clock: Option<Arc<dyn Clock>>,
    cluster: bool,
    name: String,
    calls: AtomicU64,
    checks: AtomicU64,
    /// One per call out, at most [`MAX_IN_FLIGHT`] ([`MAX_IN_FLIGHT_CLUSTER`] on a Cluster).
    permits: Arc<Semaphore>,
}

/// One request's check, waiting in the queue: its buckets already in the script's terms.
struct Pending {
    keys: SmallVec<[Key; 4]>,
    /// The page of each bucket in `keys` (`page::page_of`), in the same order.
    pages: SmallVec<[Key; 4]>,
    /// [`ARGS_PER_BUCKET`] per bucket.
    args: SmallVec<[i64; 28]>,
    /// The hash slot of its keys in a cluster: only requests of one slot share a call.
    slot: Option<u16>,
    reply: oneshot::Sender<Result<Outcome, StoreError>>,
}

impl Pending {
    fn new(batch: &[CheckItem], cluster: bool) -> (Pending, oneshot::Receiver<Result<Outcome, StoreError>>) {
        let (reply, rx) = oneshot::channel();
        let keys: SmallVec<[Key; 4]> = batch.iter().map(|i| Key::from(&*i.key)).collect();
        let pages: SmallVec<[Key; 4]> = batch.iter().map(|i| Key::from(page_of(&i.key))).collect();
        let mut args = SmallVec::new();
        for i in batch {
            let p = &i.charge.params;
            // Any need above the capacity answers the same ("never"), so cap it there and keep
            // every ARGV exact in a double.
            let need = p.units(i.charge.cost).min(p.capacity + 1);
            args.extend([
                as_i64(p.scale),
                as_i64(p.refill),
                as_i64(p.capacity),
                as_i64(need),
                as_i64(p.ttl_ms()),
                i64::from(i.charge.shadow),
                as_i64(p.debt),
            ]);
        }
        let slot = cluster.then(|| redis_keyslot(keys.first().map(|k| k.as_bytes()).unwrap_or(b"")));
        (
            Pending {
                keys,
                pages,
                args,
                slot,
                reply,
            },
            rx,
        )
    }
}

fn fred_config(target: Target<'_>) -> Result<Config, String> {
    match target {
        Target::Node(url) => {
            if url.starts_with("rediss://") {
                return Err(
                    "TLS to Redis (rediss://) is not built in; use redis:// on a trusted network".into(),
                );
            }
            Config::from_url_centralized(url)
                .map_err(|e| format!("not a usable redis:// URL: {}", e.details()))
        }
        Target::Cluster(nodes) => {
            let mut hosts = Vec::with_capacity(nodes.len());
            for n in nodes {
                let (host, port) = n
                    .rsplit_once(':')
                    .ok_or_else(|| format!("cluster node {n:?} must be HOST:PORT"))?;
                let port: u16 = port
                    .parse()
                    .map_err(|_| format!("cluster node {n:?}: {port:?} is not a port number"))?;
                if host.is_empty() {
                    return Err(format!("cluster node {n:?} has no host"));
                }
                hosts.push(Server::new(host, port));
            }
            Ok(Config {
                server: ServerConfig::Clustered {
                    hosts,
                    policy: ClusterDiscoveryPolicy::default(),
                },
                ..Config::default()
            })
        }
    }
}

fn is_noscript(e: &FredError) -> bool {
    e.details().starts_with("NOSCRIPT")
}

/// A failed call, for the caller. The script's own error replies and the store's (OOM, BUSY,
/// LOADING…) mean the store can't answer now; only a reply we can't read is a protocol error.
fn store_error(e: &FredError) -> StoreError {
    match e.kind() {
        ErrorKind::Timeout => StoreError::Timeout,
        ErrorKind::Parse | ErrorKind::Protocol => StoreError::Protocol(e.to_string()),
        _ => StoreError::Unavailable(e.details().to_string()),
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Integer(i) => Some(*i),
        _ => None,
    }
}

fn as_i64(v: u64) -> i64 {
    // Rule validation keeps every number sent to the script below 2^53.
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn kind_of(target: Target<'_>) -> (&'static str, bool) {
    match target {
        Target::Node(_) => ("redis", false),
        Target::Cluster(_) => ("redis-cluster", true),
    }
}

/// The connections: `fail_fast` makes the first connection's failure an error (start-up) rather
/// than a reconnect loop (a store that is down at start-up). A cluster gets a client per
/// primary (`nodes.rs`), each built as one node's.
fn build_client(
    target: Target<'_>,
    name: &str,
    fail_fast: bool,
    connections: usize,
) -> Result<Conn, ConnectError> {
    let bad = |reason: String| ConnectError::BadTarget {
        store: name.to_string(),
        reason,
    };
    let config = fred_config(target).map_err(bad)?;
    match config.server {
        ServerConfig::Clustered { hosts, .. } => {
            let make = move |server: &Server| {
                let config = Config {
                    server: ServerConfig::Centralized {
                        server: server.clone(),
                    },
                    fail_fast: true,
                    ..Config::default()
                };
                // A primary that drops is tried again every 100 ms: its checks fail at once
                // meanwhile (`nodes.rs`), and the map moves its slots when a replica takes over.
                build_pool(config, ReconnectPolicy::new_constant(0, 100), connections)
            };
            Ok(Conn::Cluster(Nodes::new(hosts, Box::new(make))))
        }
        _ => {
            let mut config = config;
            config.fail_fast = fail_fast;
            let policy = if fail_fast {
                ReconnectPolicy::new_exponential(0, 100, 2_000, 2)
            } else {
                ReconnectPolicy::new_constant(0, 500)
            };
            build_pool(config, policy, connections)
                .map(Conn::One)
                .map_err(|e| bad(e.details().to_string()))
        }
    }
}

fn build_pool(config: Config, policy: ReconnectPolicy, connections: usize) -> Result<Pool, FredError> {
    Builder::from_config(config)
        .with_connection_config(|c: &mut ConnectionConfig| {
            c.connection_timeout = CONNECT_TIMEOUT;
            c.internal_command_timeout = CONNECT_TIMEOUT;
            // At most once: a check whose reply was lost may have charged its buckets, so it
            // is never sent again behind the caller's back.
            c.max_command_attempts = 1;
            c.tcp = TcpConfig {
                nodelay: Some(true),
                ..TcpConfig::default()
            };
        })
        .with_performance_config(|p: &mut PerformanceConfig| {
            p.default_command_timeout = COMMAND_TIMEOUT;
        })
        .set_policy(policy)
        .build_pool(connections.max(1))
}

impl RedisStore {
    /// Connects, loads the script and runs it once: start-up fails here, with a message that
    /// names the store, if the store is unreachable, refuses the script, or (on the store's
    /// clock) refuses TIME inside a script.
    pub async fn connect(
        target: Target<'_>,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<RedisStore, ConnectError> {
        RedisStore::connect_with(target, clock, DEFAULT_CONNECTIONS).await
    }

    /// [`connect`](Self::connect) with `connections` connections per node.
    pub async fn connect_with(
        target: Target<'_>,
        clock: Option<Arc<dyn Clock>>,
        connections: usize,
    ) -> Result<RedisStore, ConnectError> {
        let name = target.to_string();
        let (kind, cluster) = kind_of(target);
        let client = build_client(target, &name, true, connections)?;
        let up = match &client {
            Conn::One(pool) => pool.init().await.map(drop),
            Conn::Cluster(nodes) => nodes.init().await,
        };
        if let Err(e) = up {
            client.quit().await;
            return Err(ConnectError::Unreachable {
                store: name.clone(),
                reason: e.details().to_string(),
            });
        }
        let shared = Shared::new(client, clock, cluster, name);
        let fail = |e: FredError, shared: &Shared| {
            let (store, reason) = (shared.name.clone(), e.details().to_string());
            match e.kind() {
                ErrorKind::Timeout | ErrorKind::IO | ErrorKind::Canceled => {
                    ConnectError::Unreachable { store, reason }
                }
                // On the store's clock the probe does nothing but read TIME.
                _ if shared.clock.is_none() => ConnectError::TimeRefused { store, reason },
                _ => ConnectError::BadProbe {
                    store,
                    answer: reason,
                },
            }
        };
        if let Err(e) = shared.load().await {
            shared.client.quit().await;
            return Err(ConnectError::ScriptLoad {
                store: shared.name.clone(),
                reason: e.details().to_string(),
            });
        }
        if let Err(e) = shared.probe().await {
            shared.client.quit().await;
            return Err(fail(e, &shared));
        }
        Ok(RedisStore::start(shared, kind))
    }

    /// A store that is down at start-up: the client connects (and reconnects) in the background
    /// and the script is loaded at the first NOSCRIPT. Meanwhile every call fails, and the
    /// failure policies decide.
    pub fn connect_later(
        target: Target<'_>,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<RedisStore, ConnectError> {
        let name = target.to_string();
        let (kind, cluster) = kind_of(target);
        // Keep trying the first connection as if it had dropped.
        let client = build_client(target, &name, false, DEFAULT_CONNECTIONS)?;
        // The connection tasks run on their own; their handle is not needed. A cluster's map is
        // read by its refresher once a node answers.
        if let Conn::One(pool) = &client {
            drop(pool.connect());
        }
        Ok(RedisStore::start(Shared::new(client, clock, cluster, name), kind))
    }

    /// Starts the queue's task: needs a tokio runtime.
    fn start(shared: Arc<Shared>, kind: &'static str) -> RedisStore {
        super::page::prepare();
        if let Conn::Cluster(nodes) = &shared.client {
            nodes.spawn_refresher();
        }
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(run_queue(shared.clone(), rx));
        RedisStore { shared, queue, kind }
    }

    /// The script's SHA-1, as sent by `EVALSHA`.
    pub fn script_sha(&self) -> &str {
        &self.shared.sha
    }

    /// The store's name as given (`redis://…` or `redis-cluster://…`).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Script calls made and request checks they carried, since connecting (checks per call
    /// above 1 means the store fell behind and requests shared calls).
    pub fn calls_and_checks(&self) -> (u64, u64) {
        (
            self.shared.calls.load(Ordering::Relaxed),
            self.shared.checks.load(Ordering::Relaxed),
        )
    }

    /// The time the store's script reads now, in microseconds (or the gateway's, with
    /// `--clock gateway`).
    pub async fn now_us(&self) -> Result<u64, StoreError> {
        self.shared.probe().await.map_err(|e| store_error(&e))
    }

    /// Checks one batch in the store.
    pub async fn check_batch(&self, batch: &[CheckItem]) -> Result<Outcome, StoreError> {
        if batch.is_empty() {
            let now_us = self.now_us().await?;
            return Ok(Outcome {
                admitted: true,
                now_us,
                buckets: SmallVec::new(),
                source: Source::Store,
                leased: 0,
            });
        }
        let (pending, rx) = Pending::new(batch, self.shared.cluster);
        // On one node, through the queue even when a call slot is free: sent from here, each
        // request of a burst took a call of its own while slots lasted (4.3 checks a call in
        // row R against 8.1 through the queue, and redis-server's CPU per request 16% higher).
        // On a cluster checks of one slot rarely meet, so a free slot sends at once.
        if self.shared.cluster
            && let Ok(permit) = self.shared.permits.clone().try_acquire_owned()
        {
            self.shared.call(vec![pending]).await;
            drop(permit);
        } else if self.queue.send(pending).is_err() {
            return Err(StoreError::Unavailable(
                "the Redis store's queue has stopped".into(),
            ));
        }
        rx.await.unwrap_or_else(|_| {
            Err(StoreError::Unavailable(
                "the Redis store's queue has stopped".into(),
            ))
        })
    }

    /// Checks several requests in one script call, in order, at one `now`: what the queue does
    /// when the store falls behind. All batches must share a hash slot in a cluster.
    pub async fn check_together(
        &self,
        batches: &[&[CheckItem]],
    ) -> Result<Vec<Result<Outcome, StoreError>>, StoreError> {
        let mut receivers = Vec::with_capacity(batches.len());
        let mut pending = Vec::with_capacity(batches.len());
        for b in batches {
            let (p, rx) = Pending::new(b, self.shared.cluster);
            pending.push(p);
            receivers.push(rx);
        }
        self.shared.call(pending).await;
        let mut out = Vec::with_capacity(receivers.len());
        for rx in receivers {
            out.push(
                rx.await
                    .map_err(|_| StoreError::Unavailable("no answer".into()))?,
            );
        }
        Ok(out)
    }
}

impl Shared {
    fn new(client: Conn, clock: Option<Arc<dyn Clock>>, cluster: bool, name: String) -> Arc<Shared> {
        Arc::new(Shared {
            client,
            sha: fred::util::sha1_hash(SCRIPT).into(),
            lease_sha: fred::util::sha1_hash(LEASE_SCRIPT).into(),
            refund_sha: fred::util::sha1_hash(REFUND_SCRIPT).into(),
            clock,
            cluster,
            name,
            calls: AtomicU64::new(0),
            checks: AtomicU64::new(0),
            permits: Arc::new(Semaphore::new(if cluster {
                MAX_IN_FLIGHT_CLUSTER
            } else {
                MAX_IN_FLIGHT
            })),
        })
    }

    /// `SCRIPT LOAD` of every script on every primary.
    async fn load(&self) -> Result<(), FredError> {
        self.client.load(SCRIPT).await?;
        self.client.load(LEASE_SCRIPT).await?;
        self.client.load(REFUND_SCRIPT).await
    }

    fn clock_arg(&self) -> i64 {
        match &self.clock {
            None => STORE_CLOCK,
            Some(c) => as_i64(c.now_us()),
        }
    }

    /// EVALSHA, and on NOSCRIPT (a failover or SCRIPT FLUSH emptied the cache) load the script
    /// again and retry once. `request` builds the call, so nothing is cloned for the retry.
    async fn eval(&self, request: impl Fn() -> (Vec<Key>, Vec<Value>)) -> Result<Value, FredError> {
        self.eval_script(&self.sha, request).await
    }

    /// [`Shared::eval`] for either script.
    async fn eval_script(
        &self,
        sha: &Str,
        request: impl Fn() -> (Vec<Key>, Vec<Value>),
    ) -> Result<Value, FredError> {
        let (keys, args) = request();
        match self.client.run(Script::Sha(sha), keys, args).await {
            Err(e) if is_noscript(&e) => {
                tracing::info!(store = %self.name, "the store lost its scripts (NOSCRIPT); loading them again");
                self.load().await?;
                let (keys, args) = request();
                self.client.run(Script::Sha(sha), keys, args).await
            }
            other => other,
        }
    }

    /// The script with no requests: `{now}`.
    async fn probe(&self) -> Result<u64, FredError> {
        let v = self
            .eval(|| {
                (
                    Vec::new(),
                    vec![Value::Integer(self.clock_arg()), Value::Integer(0)],
                )
            })
            .await?;
        match v {
            Value::Array(items) if items.len() == 1 => items
                .first()
                .and_then(int)
                .and_then(|n| u64::try_from(n).ok())
                .ok_or_else(|| FredError::new(ErrorKind::Parse, format!("probe answered {items:?}"))),
            other => Err(FredError::new(
                ErrorKind::Parse,
                format!("probe answered {other:?}"),
            )),
        }
    }

    /// One script call for `requests`; every request gets its answer on its own channel.
    async fn call(&self, requests: Vec<Pending>) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.checks.fetch_add(requests.len() as u64, Ordering::Relaxed);
        let build = || encode_call(self.clock_arg(), &requests);
        let reply = self.eval(build).await;
        let sizes: SmallVec<[usize; 16]> = requests.iter().map(|r| r.keys.len()).collect();
        match reply
            .map_err(|e| store_error(&e))
            .and_then(|v| parse_reply(&sizes, v))
        {
            Ok(outcomes) => {
                for (r, o) in requests.into_iter().zip(outcomes) {
                    let _ = r.reply.send(o);
                }
            }
            Err(e) => {
                for r in requests {
                    let _ = r.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// How many earlier buckets of a call a bucket is compared with to find its repeat. The
/// requests that share a call are mostly one client's burst, whose buckets are among the first
/// few; a bucket past these is sent as new, which the script reads and writes correctly, only
/// at the cost of its rule's arguments.
const REPEAT_SCAN: usize = 32;

/// KEYS and ARGV of one `lua/check.lua` call for `requests` (the script's header has the
/// layout): a bucket that an earlier request of the call named with the same rule is sent as a
/// reference to it and its need, and the first is flagged to be kept between checks.
fn encode_call(clock: i64, requests: &[Pending]) -> (Vec<Key>, Vec<Value>) {
    let nbuckets: usize = requests.iter().map(|r| r.keys.len()).sum();
    let mut keys = Vec::with_capacity(2 * nbuckets);
    let mut pages = Vec::with_capacity(nbuckets);
    let mut args = Vec::with_capacity(2 + requests.len() + ARGS_PER_BUCKET * nbuckets);
    args.push(Value::Integer(clock));
    args.push(Value::Integer(requests.len() as i64));
    // Each bucket sent in full: where its flags are in `args`, and its numbers.
    let mut sent: SmallVec<[(usize, &[i64]); 8]> = SmallVec::new();
    for r in requests {
        args.push(Value::Integer(r.keys.len() as i64));
        let buckets = r
            .keys
            .iter()
            .zip(&r.pages)
            .zip(r.args.chunks_exact(ARGS_PER_BUCKET));
        for ((key, page), rule) in buckets {
            let need = rule[NEED];
            let mut repeat = None;
            for (e, &(flags_at, first)) in sent.iter().enumerate().take(REPEAT_SCAN) {
                if keys[e] != *key {
                    continue;
                }
                // Named again: kept between its checks, whatever the rule.
                args[flags_at] = Value::Integer(first[FLAGS] | KEEP);
                let same = |i: usize| i == NEED || first[i] == rule[i];
                if (0..ARGS_PER_BUCKET).all(same) {
                    repeat = Some(e);
                    break;
                }
            }
            match repeat {
                Some(e) => args.extend([Value::Integer(-(e as i64 + 1)), Value::Integer(need)]),
                None => {
                    sent.push((args.len() + FLAGS, rule));
                    keys.push(key.clone());
                    pages.push(page.clone());
                    args.extend(rule.iter().map(|&v| Value::Integer(v)));
                }
            }
        }
    }
    keys.extend(pages);
    (keys, args)
}

/// The queue: checks that found every call slot taken wait here, and go together (per hash
/// slot in a cluster) in the next call as soon as a slot frees. Ends when the store is dropped.
async fn run_queue(shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Pending>) {
    let permits = shared.permits.clone();
    let mut held: Option<Pending> = None;
    loop {
        let first = match held.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        // A caller that gave up while its check waited (a timeout) is not charged for it.
        if first.reply.is_closed() {
            continue;
        }
        let mut keys = first.keys.len();
        let slot = first.slot;
        let mut requests = vec![first];
        while requests.len() < MAX_REQUESTS_PER_CALL {
            let Ok(next) = rx.try_recv() else { break };
            if next.reply.is_closed() {
                continue;
            }
            if next.slot != slot || keys + next.keys.len() > MAX_KEYS_PER_CALL {
                // Another slot (or a full call): it leads the next call.
                held = Some(next);
                break;
            }
            keys += next.keys.len();
            requests.push(next);
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            shared.call(requests).await;
            drop(permit);
        });
    }
}

/// Reads `{now, allowed_1, tokens, wait, …, allowed_2, …}` for requests of `sizes` buckets.
fn parse_reply(sizes: &[usize], reply: Value) -> Result<Vec<Result<Outcome, StoreError>>, StoreError> {
    let bad = |what: String| StoreError::Protocol(format!("lua/check.lua answered {what}"));
    let Value::Array(items) = reply else {
        return Err(bad(format!("{reply:?}, not an array")));
    };
    let expected = 1 + sizes.iter().map(|n| 1 + 2 * n).sum::<usize>();
    if items.len() != expected {
        return Err(bad(format!("{} values, not {expected}", items.len())));
    }
    let num = |i: usize| -> Result<i64, StoreError> {
        int(&items[i]).ok_or_else(|| bad(format!("{:?} at {}, not an integer", items[i], i + 1)))
    };
    let now_us = u64::try_from(num(0)?).map_err(|_| bad("a negative now".into()))?;
    let mut at = 1;
    let mut out = Vec::with_capacity(sizes.len());
    for &n in sizes {
        let admitted = num(at)?;
        at += 1;
        let admitted = match admitted {
            0 => false,
            1 => true,
            -1 => {
                at += 2 * n;
                out.push(Err(StoreError::Protocol(
                    "a bucket of this request holds a value lua/check.lua did not write".into(),
                )));
                continue;
            }
            other => return Err(bad(format!("admitted = {other}"))),
        };
        let mut buckets = SmallVec::with_capacity(n);
        for _ in 0..n {
            let tokens = u64::try_from(num(at)?).map_err(|_| bad("negative tokens".into()))?;
            let wait_us = match num(at + 1)? {
                -1 => None,
                w => Some(u64::try_from(w).map_err(|_| bad(format!("wait {w}")))?),
            };
            at += 2;
            buckets.push(BucketVerdict {
                sufficient: wait_us == Some(0),
                tokens,
                wait_us,
            });
        }
        out.push(Ok(Outcome {
            admitted,
            now_us,
            buckets,
            source: Source::Store,
            leased: 0,
        }));
    }
    Ok(out)
}

/// ARGV of one `lua/lease.lua` call: the clock, the operation, the bucket's numbers, the units,
/// for a lease one block cycle, and the caller's account for its record.
fn lease_args(
    clock: i64,
    op: &'static str,
    p: &BucketParams,
    units: u64,
    cycle_us: u64,
    acct: &Account<'_>,
) -> Vec<Value> {
    vec![
        Value::Integer(clock),
        Value::from(op),
        Value::Integer(as_i64(p.scale)),
        Value::Integer(as_i64(p.refill)),
        Value::Integer(as_i64(p.capacity)),
        // Never more than the capacity: a block is at most the burst, and a give-back of more
        // than the capacity fills the bucket all the same.
        Value::Integer(as_i64(units.min(p.capacity))),
        Value::Integer(as_i64(p.ttl_ms())),
        Value::Integer(as_i64(cycle_us)),
        Value::from(acct.holder),
        Value::Integer(as_i64(acct.spent)),
        Value::Integer(as_i64(RECORD_TTL_US)),
    ]
}

/// The two keys of a `lua/lease.lua` call: the bucket and its records.
fn lease_keys(key: &str) -> Vec<Key> {
    vec![Key::from(key), Key::from(page_of(key)), Key::from(held_key(key))]
}

/// Reads `{granted, now, tokens, until, reclaimed, held}`.
fn parse_lease_reply(reply: Value) -> Result<([u64; 4], Recorded), StoreError> {
    let bad = |what: String| StoreError::Protocol(format!("lua/lease.lua answered {what}"));
    let Value::Array(items) = reply else {
        return Err(bad(format!("{reply:?}, not an array")));
    };
    if items.len() != 6 {
        return Err(bad(format!("{} values, not 6", items.len())));
    }
    let mut n = [0u64; 6];
    for (i, v) in items.iter().enumerate() {
        n[i] = int(v)
            .and_then(|x| u64::try_from(x).ok())
            .ok_or_else(|| bad(format!("{v:?} at {}, not a non-negative integer", i + 1)))?;
    }
    if n[0] > 1 {
        return Err(bad(format!("granted = {}", n[0])));
    }
    let recorded = Recorded {
        reclaimed: n[4],
        held: n[5],
    };
    Ok(([n[0], n[1], n[2], n[3]], recorded))
}

impl RedisStore {
    /// LEASE: a whole block of `block` tokens from the bucket `key`, or nothing and the store
    /// time before which to ask again (`now + cycle_us`); expired records reclaimed first, and
    /// the grant and `acct`'s spending noted in the caller's record.
    pub async fn lease(
        &self,
        key: &str,
        p: &BucketParams,
        block: u64,
        cycle_us: u64,
        acct: Account<'_>,
    ) -> Result<LeaseReply, StoreError> {
        let reply = self
            .shared
            .eval_script(&self.shared.lease_sha, || {
                (
                    lease_keys(key),
                    lease_args(
                        self.shared.clock_arg(),
                        "lease",
                        p,
                        p.units(block),
                        cycle_us,
                        &acct,
                    ),
                )
            })
            .await
            .map_err(|e| store_error(&e))?;
        let ([granted, now_us, units_left, until_us], recorded) = parse_lease_reply(reply)?;
        let grant = if granted == 1 {
            Grant::Granted { tokens: block }
        } else {
            if until_us < now_us {
                return Err(StoreError::Protocol(format!(
                    "lua/lease.lua refused with until {until_us} before now {now_us}"
                )));
            }
            Grant::Denied { until_us }
        };
        Ok(LeaseReply {
            grant,
            now_us,
            units_left,
            recorded,
        })
    }

    /// GIVE BACK: `tokens` unused tokens added to the bucket `key`, capped at its burst;
    /// expired records reclaimed first, and the tokens and `acct`'s spending taken off the
    /// caller's record.
    pub async fn give_back(
        &self,
        key: &str,
        p: &BucketParams,
        tokens: u64,
        acct: Account<'_>,
    ) -> Result<GiveBackReply, StoreError> {
        let reply = self
            .shared
            .eval_script(&self.shared.lease_sha, || {
                (
                    lease_keys(key),
                    lease_args(self.shared.clock_arg(), "give", p, p.units(tokens), 0, &acct),
                )
            })
            .await
            .map_err(|e| store_error(&e))?;
        let ([_, now_us, units_left, _], recorded) = parse_lease_reply(reply)?;
        Ok(GiveBackReply {
            now_us,
            units_left,
            recorded,
        })
    }

    /// The lease script's SHA-1.
    pub fn lease_script_sha(&self) -> &str {
        &self.shared.lease_sha
    }
}

impl RedisStore {
    /// Gives back what the check that answered `outcome` charged `batch`, in one call of
    /// `lua/refund.lua`; see [`Store::refund`]. `None` when it charged nothing (a limited
    /// request), and then no call is made.
    pub async fn refund_batch(
        &self,
        batch: &[CheckItem],
        outcome: &Outcome,
    ) -> Result<Option<Adjusted>, StoreError> {
        if batch.len() != outcome.buckets.len() {
            return Err(mismatch(batch, outcome));
        }
        let units = crate::refund_units(batch, outcome);
        if units.iter().all(|u| *u == 0) {
            return Ok(None);
        }
        self.adjust_batch(batch, &units).await.map(Some)
    }

    /// Adds `units[i]` to the bucket of `batch[i]` in one call of `lua/refund.lua` (none when
    /// every amount is 0); see [`Store::adjust`].
    pub async fn adjust_batch(&self, batch: &[CheckItem], units: &[i64]) -> Result<Adjusted, StoreError> {
        let n = units.iter().filter(|u| **u != 0).count();
        if n == 0 {
            return Ok(Adjusted::none(batch.len()));
        }
        let reply = self
            .shared
            .eval_script(&self.shared.refund_sha, || {
                let mut keys = Vec::with_capacity(2 * n);
                let mut pages = Vec::with_capacity(n);
                let mut args = Vec::with_capacity(1 + 6 * n);
                args.push(Value::Integer(self.shared.clock_arg()));
                for (item, &u) in batch.iter().zip(units).filter(|(_, u)| **u != 0) {
                    let p = &item.charge.params;
                    keys.push(Key::from(&*item.key));
                    pages.push(Key::from(page_of(&item.key)));
                    args.extend(
                        [
                            as_i64(p.scale),
                            as_i64(p.refill),
                            as_i64(p.capacity),
                            u,
                            as_i64(p.ttl_ms()),
                            as_i64(p.debt),
                        ]
                        .map(Value::Integer),
                    );
                }
                keys.extend(pages);
                (keys, args)
            })
            .await
            .map_err(|e| store_error(&e))?;
        let bad = |what: String| StoreError::Protocol(format!("lua/refund.lua answered {what}"));
        let Value::Array(items) = reply else {
            return Err(bad(format!("{reply:?}, not an array")));
        };
        if items.len() != 1 + n {
            return Err(bad(format!("{} values, not {}", items.len(), 1 + n)));
        }
        let mut nums = items
            .iter()
            .map(|v| int(v).ok_or_else(|| bad(format!("{v:?}, not an integer"))));
        let now_us = nums
            .next()
            .unwrap_or_else(|| Err(bad("nothing".into())))
            .and_then(|x| u64::try_from(x).map_err(|_| bad(format!("the time {x}"))))?;
        let mut balances = SmallVec::with_capacity(batch.len());
        for &u in units {
            balances.push(if u != 0 { nums.next().transpose()? } else { None });
        }
        Ok(Adjusted { now_us, balances })
    }

    /// The refund script's SHA-1.
    pub fn refund_script_sha(&self) -> &str {
        &self.shared.refund_sha
    }
}

impl Lessor for RedisStore {
    fn lease<'a>(
        &'a self,
        key: &'a str,
        p: &'a BucketParams,
        block: u64,
        cycle_us: u64,
        acct: Account<'a>,
    ) -> BoxFuture<'a, Result<LeaseReply, StoreError>> {
        Box::pin(RedisStore::lease(self, key, p, block, cycle_us, acct))
    }

    fn give_back<'a>(
        &'a self,
        key: &'a str,
        p: &'a BucketParams,
        tokens: u64,
        acct: Account<'a>,
    ) -> BoxFuture<'a, Result<GiveBackReply, StoreError>> {
        Box::pin(RedisStore::give_back(self, key, p, tokens, acct))
    }
}

impl Store for RedisStore {
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        CheckFuture::Boxed(Box::pin(self.check_batch(batch)))
    }

    fn kind(&self) -> &'static str {
        self.kind
    }

    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
        Box::pin(async move {
            if let Some(e) = crate::units_mismatch(batch, outcome, units) {
                return Err(e);
            }
            self.adjust_batch(batch, units).await
        })
    }

    /// Runs the script with no keys: the store answers, still has the script (or takes it
    /// again), and can read its clock.
    fn ping(&self) -> CheckFuture<'_> {
        CheckFuture::Boxed(Box::pin(self.check_batch(&[])))
    }

    fn heartbeat<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Option<u32>, StoreError>> {
        Box::pin(async move {
            let n = self
                .shared
                .client
                .run(
                    Script::Text(HEARTBEAT),
                    vec![Key::from(FLEET_KEY)],
                    vec![Value::from(instance), Value::Integer(FLEET_WINDOW_MS)],
                )
                .await
                .map_err(|e| store_error(&e))?;
            let n = int(&n).ok_or_else(|| StoreError::Protocol(format!("the heartbeat answered {n:?}")))?;
            Ok(u32::try_from(n).ok().filter(|n| *n > 0))
        })
    }

    fn remote(&self) -> bool {
        true
    }
}

/// Who is alive: a sorted set of gateway instances scored by the store's clock (ms), pruned of
/// those silent for [`FLEET_WINDOW_MS`]. One key, so it works on a cluster too.
const FLEET_KEY: &str = "tollgate:{fleet}:members";
const FLEET_WINDOW_MS: i64 = 5_000;
const HEARTBEAT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
return redis.call('ZCARD', KEYS[1])
"#;

/// A client to the same store for work beside the limiter (metering's records and flags): it
/// reconnects on its own and retries, unlike the check's at-most-once connections, because
/// what it sends is idempotent.
pub fn side_client(target: Target<'_>) -> Result<fred::clients::Client, String> {
    let config = fred_config(target)?;
    Builder::from_config(config)
        .with_connection_config(|c: &mut ConnectionConfig| {
            c.connection_timeout = CONNECT_TIMEOUT;
            c.internal_command_timeout = CONNECT_TIMEOUT;
        })
        .set_policy(ReconnectPolicy::new_exponential(0, 100, 1_000, 2))
        .build()
        .map_err(|e| e.details().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_is_read_strictly() {
        let v = |xs: &[i64]| Value::Array(xs.iter().map(|&x| Value::Integer(x)).collect());
        let out = parse_reply(&[1, 2], v(&[17, 0, 5, -1, 1, 3, 0, 4, 0])).unwrap();
        let first = out[0].as_ref().unwrap();
        assert!(!first.admitted);
        assert_eq!(first.now_us, 17);
        assert_eq!(first.buckets[0].wait_us, None);
        assert!(!first.buckets[0].sufficient);
        let second = out[1].as_ref().unwrap();
        assert!(second.admitted && second.buckets.len() == 2 && second.buckets[1].tokens == 4);
        let corrupt = parse_reply(&[1, 1], v(&[17, -1, 0, 0, 1, 9, 0])).unwrap();
        assert!(corrupt[0].is_err() && corrupt[1].is_ok());
        assert!(parse_reply(&[2], v(&[17, 1, 1, 0])).is_err());
        assert!(parse_reply(&[0], v(&[17, 2])).is_err());
        assert!(parse_reply(&[], Value::Null).is_err());
    }

    fn item(key: &str, rate: &str, cost: u64, shadow: bool) -> CheckItem {
        let params = BucketParams::new(tollgate_limit::bucket::Rate::parse(rate).unwrap(), 10).unwrap();
        let charge = tollgate_limit::bucket::Charge { params, cost, shadow };
        CheckItem::new(key.into(), charge, 0, super::super::FailurePolicy::Local)
    }

    fn ints(args: &[Value]) -> Vec<i64> {
        args.iter().map(|v| int(v).unwrap()).collect()
    }

    /// A bucket named again with its rule goes as a reference and its need, and its first
    /// mention is flagged to be kept; under another rule (or as shadow) it goes in full.
    #[test]
    fn a_call_names_each_bucket_and_rule_once() {
        let a = || item("rl:{k}:a", "5/1s", 1, false);
        let b = item("rl:{k}:b", "5/1s", 2, false);
        let requests = [
            vec![a(), b.clone()],
            vec![item("rl:{k}:a", "5/1s", 3, false)],
            vec![a()],
            vec![
                item("rl:{k}:a", "9/1s", 1, false),
                item("rl:{k}:b", "5/1s", 2, true),
            ],
        ];
        let pending: Vec<Pending> = requests.iter().map(|r| Pending::new(r, false).0).collect();
        let (keys, args) = encode_call(-1, &pending);
        let names: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let (a5, b5, a9) = (
            &pending[0].args[..7],
            &pending[0].args[7..],
            &pending[3].args[..7],
        );
        let b_shadow = &pending[3].args[7..];
        let (page_a, page_b) = (page_of("rl:{k}:a"), page_of("rl:{k}:b"));
        let (page_a, page_b) = (page_a.as_bytes(), page_b.as_bytes());
        let want: [&[u8]; 8] = [
            b"rl:{k}:a",
            b"rl:{k}:b",
            b"rl:{k}:a",
            b"rl:{k}:b",
            page_a,
            page_b,
            page_a,
            page_b,
        ];
        assert_eq!(names, want);
        let flagged = |rule: &[i64], flags: i64| {
            let mut r = rule.to_vec();
            r[FLAGS] = flags;
            r
        };
        let mut want = vec![-1, 4, 2];
        want.extend(flagged(a5, KEEP));
        want.extend(flagged(b5, KEEP));
        want.extend([1, -1, a5[NEED] * 3]);
        want.extend([1, -1, a5[NEED]]);
        want.push(2);
        want.extend(flagged(a9, 0));
        want.extend(flagged(b_shadow, 1));
        assert_eq!(ints(&args), want);
        assert_eq!(b_shadow[FLAGS], 1);
    }
}
