//! A Redis Cluster reached one primary at a time: the slot map read with `CLUSTER SLOTS`, one
//! fred client per primary, and the cluster's redirections (`MOVED`, `ASK`, `TRYAGAIN`,
//! `CLUSTERDOWN`) followed here.
//!
//! fred's cluster client keeps every node's connection in one routing task, and when one node
//! drops it reconnects to all of them before it sends anything else; a node that refuses the
//! connection fails that reconnect, so it tries again and again until the cluster stops
//! listing the node. For the whole failover of one master (the node timeout and an election:
//! seconds) the checks of the healthy masters' slots waited as well, and timed out. Here every
//! primary has a client of its own that reconnects alone: a check goes to the client of its
//! slot's primary in the map last read, and a client that is not connected fails the check at
//! once, so that slot's failure policies decide without waiting for the timeout.
//!
//! The map is read again in the background when a node fails, answers `MOVED` or says the
//! cluster is down (at most every [`REFRESH_GAP`]), and every [`REFRESH_EVERY`] besides, so a
//! promoted replica gets its slots' checks within a refresh of its promotion. A redirection is
//! a node declining to run the command, so following one keeps every call at most once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use fred::prelude::{
    ClientLike, ClusterInterface, Error as FredError, ErrorKind, Key, LuaInterface, Pool, Server, Value,
};
use fred::types::CustomCommand;
use fred::types::cluster::ClusterRouting;
use fred::util::redis_keyslot;
use tokio::time::Instant;

/// The least time between two reads of the map that a failure asks for.
pub(crate) const REFRESH_GAP: Duration = Duration::from_millis(100);
/// How often the map is read even when nothing failed: slots moved by an operator show up as
/// `MOVED` at once, but a node that joined as a primary would not.
pub(crate) const REFRESH_EVERY: Duration = Duration::from_secs(1);
/// How long reading the map from one node, or connecting to a new primary, may take.
const REFRESH_TIMEOUT: Duration = Duration::from_millis(500);
/// `MOVED` and `ASK` followed in a row before a call pauses, as for `TRYAGAIN`.
const MAX_REDIRECTIONS: usize = 16;
/// The first pause before a call the cluster asked to try again (`TRYAGAIN`: a slot half
/// moved, which takes a millisecond or so to finish; `CLUSTERDOWN`), doubled up to
/// [`TRY_AGAIN_MAX`] each time.
const TRY_AGAIN_AFTER: Duration = Duration::from_millis(1);
const TRY_AGAIN_MAX: Duration = Duration::from_millis(10);
/// How long one call keeps trying again; the guard's timeout, far shorter, usually ends it
/// first, and the limits' failure policies decide.
const TRY_AGAIN_FOR: Duration = Duration::from_secs(2);

/// What one call runs on a node.
#[derive(Clone, Copy)]
pub(crate) enum Script<'a> {
    /// `EVALSHA` of a loaded script.
    Sha(&'a str),
    /// `EVAL` of the script's text.
    Text(&'a str),
}

/// Builds the client of one node: the caller's settings (timeouts, at most one attempt).
pub(crate) type MakePool = Box<dyn Fn(&Server) -> Result<Pool, FredError> + Send + Sync>;

pub(crate) struct Nodes {
    seeds: Vec<Server>,
    make: MakePool,
    map: RwLock<Map>,
    /// Held while the map is read, so one read runs at a time; holds when the last one ended.
    refresh: Arc<tokio::sync::Mutex<Option<Instant>>>,
    /// The end of the last read, for [`Nodes::refresh_soon`] to check without waiting.
    last: Mutex<Option<Instant>>,
}

struct Map {
    routing: ClusterRouting,
    primaries: HashMap<Server, Pool>,
}

/// What a node answered instead of running the call.
enum Redirect {
    /// The slot lives on that node now.
    Moved(Server),
    /// The slot is moving to that node and this key is there already.
    Ask(Server),
    /// The keys are split between the two nodes of a moving slot.
    TryAgain,
    /// The node can't serve the slot now (no majority, or the slot has no master yet).
    Down,
}

fn redirect(e: &FredError) -> Option<Redirect> {
    let mut words = e.details().split_whitespace();
    let kind = words.next()?;
    let server = |mut w: std::str::SplitWhitespace<'_>| {
        let (host, port) = w.nth(1)?.rsplit_once(':')?;
        Some(Server::new(host, port.parse().ok()?))
    };
    match kind {
        "MOVED" => server(words).map(Redirect::Moved),
        "ASK" => server(words).map(Redirect::Ask),
        "TRYAGAIN" => Some(Redirect::TryAgain),
        "CLUSTERDOWN" => Some(Redirect::Down),
        _ => None,
    }
}

fn unreachable(what: String) -> FredError {
    FredError::new(ErrorKind::IO, what)
}

impl Nodes {
    pub(crate) fn new(seeds: Vec<Server>, make: MakePool) -> Arc<Nodes> {
        Arc::new(Nodes {
            seeds,
            make,
            map: RwLock::new(Map {
                routing: ClusterRouting::new(),
                primaries: HashMap::new(),
            }),
            refresh: Arc::new(tokio::sync::Mutex::new(None)),
            last: Mutex::new(None),
        })
    }

    /// Reads the map and connects to every primary: start-up fails here when it can't.
    pub(crate) async fn init(&self) -> Result<(), FredError> {
        let mut last = self.refresh.lock().await;
        let r = self.read_and_connect().await;
        self.ended(&mut last);
        r
    }

    /// Reads the map every [`REFRESH_EVERY`] until the nodes are dropped.
    pub(crate) fn spawn_refresher(self: &Arc<Self>) {
        let weak: Weak<Nodes> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REFRESH_EVERY);
            loop {
                tick.tick().await;
                let Some(nodes) = weak.upgrade() else { break };
                nodes.refresh_soon();
            }
        });
    }

    fn ended(&self, last: &mut Option<Instant>) {
        let now = Instant::now();
        *last = Some(now);
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
    }

    /// Reads the map again in the background, unless a read runs or ended within
    /// [`REFRESH_GAP`].
    pub(crate) fn refresh_soon(self: &Arc<Self>) {
        let recent = self
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|t| t.elapsed() < REFRESH_GAP);
        if recent {
            return;
        }
        let Ok(mut guard) = self.refresh.clone().try_lock_owned() else {
            return;
        };
        let nodes = self.clone();
        tokio::spawn(async move {
            if let Err(e) = nodes.read_and_connect().await {
                tracing::debug!(error = %e, "could not read the cluster's slot map");
            }
            nodes.ended(&mut guard);
        });
    }

    /// The map from the first node that answers (the primaries known, then the seeds), the
    /// new primaries connected and the ones gone closed.
    async fn read_and_connect(&self) -> Result<(), FredError> {
        let routing = self.read_map().await?;
        let wanted = routing.unique_primary_nodes();
        let missing: Vec<Server> = {
            let map = self.map.read().unwrap_or_else(|p| p.into_inner());
            wanted
                .iter()
                .filter(|s| !map.primaries.contains_key(*s))
                .cloned()
                .collect()
        };
        let mut joined = Vec::with_capacity(missing.len());
        let mut failed = None;
        for server in missing {
            match self.connect(&server).await {
                Ok(pool) => joined.push((server, pool)),
                Err(e) => failed = Some(e),
            }
        }
        let gone: Vec<Pool> = {
            let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
            map.primaries.extend(joined);
            let old: Vec<Server> = map
                .primaries
                .keys()
                .filter(|s| !wanted.contains(*s))
                .cloned()
                .collect();
            map.routing = routing;
            old.iter().filter_map(|s| map.primaries.remove(s)).collect()
        };
        for pool in gone {
            tokio::spawn(async move {
                let _ = pool.quit().await;
            });
        }
        failed.map_or(Ok(()), Err)
    }

    async fn connect(&self, server: &Server) -> Result<Pool, FredError> {
        let pool = (self.make)(server)?;
        match tokio::time::timeout(REFRESH_TIMEOUT, pool.init()).await {
            Ok(Ok(_)) => Ok(pool),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                let _ = pool.quit().await;
                Err(unreachable(format!("cluster node {server} did not answer")))
            }
        }
    }

    async fn read_map(&self) -> Result<ClusterRouting, FredError> {
        let known: Vec<(Server, Pool)> = {
            let map = self.map.read().unwrap_or_else(|p| p.into_inner());
            map.primaries
                .iter()
                .filter(|(_, p)| p.next().is_connected())
                .map(|(s, p)| (s.clone(), p.clone()))
                .collect()
        };
        let mut last = unreachable("no cluster node answered CLUSTER SLOTS".into());
        for (server, pool) in known {
            match slots_of(&pool, &server).await {
                Ok(r) => return Ok(r),
                Err(e) => last = e,
            }
        }
        for seed in &self.seeds {
            let pool = match self.connect(seed).await {
                Ok(p) => p,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            let r = slots_of(&pool, seed).await;
            let _ = pool.quit().await;
            match r {
                Ok(r) => return Ok(r),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// The client of `server`: one of the primaries, or a new one (a `MOVED` or `ASK` to a node
    /// the map does not know yet).
    async fn pool_of(&self, server: &Server) -> Result<Pool, FredError> {
        if let Some(p) = self
            .map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .primaries
            .get(server)
        {
            return Ok(p.clone());
        }
        let pool = self.connect(server).await?;
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        Ok(map.primaries.entry(server.clone()).or_insert(pool).clone())
    }

    /// The primary of `slot` in the map, or for a call without keys (`/readyz`, the clock) a
    /// connected one: one master away does not make the store unready.
    fn route(&self, slot: Option<u16>) -> Result<(Server, Pool), FredError> {
        let map = self.map.read().unwrap_or_else(|p| p.into_inner());
        let server = match slot {
            Some(s) => map.routing.get_server(s).cloned(),
            None => map
                .primaries
                .iter()
                .filter(|(_, p)| p.next().is_connected())
                .map(|(s, _)| s)
                .min()
                .or_else(|| map.primaries.keys().min())
                .cloned(),
        }
        .ok_or_else(|| unreachable("no cluster node serves this slot yet".into()))?;
        let pool = map
            .primaries
            .get(&server)
            .cloned()
            .ok_or_else(|| unreachable(format!("no connection to cluster node {server}")))?;
        Ok((server, pool))
    }

    /// Runs `script` on the primary of its keys' slot, following redirections.
    pub(crate) async fn run(
        self: &Arc<Self>,
        script: Script<'_>,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Result<Value, FredError> {
        let slot = keys.first().map(|k| redis_keyslot(k.as_bytes()));
        // Where a redirection sent the call, and whether it must say ASKING first.
        let mut to: Option<(Server, bool)> = None;
        let started = Instant::now();
        let mut pause = TRY_AGAIN_AFTER;
        let mut redirections = 0;
        loop {
            let (server, pool, asking) = match to.take() {
                Some((server, asking)) => {
                    let pool = self.pool_of(&server).await?;
                    (server, pool, asking)
                }
                None => {
                    let (server, pool) = self.route(slot).inspect_err(|_| self.refresh_soon())?;
                    (server, pool, false)
                }
            };
            let client = pool.next();
            if !client.is_connected() {
                self.refresh_soon();
                return Err(unreachable(format!("cluster node {server} is not connected")));
            }
            let reply = if asking {
                let p = client.pipeline();
                let _: () = p
                    .custom(
                        CustomCommand::new_static("ASKING", None, false),
                        Vec::<Value>::new(),
                    )
                    .await?;
                // A pipeline has no script commands of its own: the same call, spelled out.
                let (name, body) = match script {
                    Script::Sha(sha) => ("EVALSHA", sha),
                    Script::Text(text) => ("EVAL", text),
                };
                let mut raw: Vec<Value> = Vec::with_capacity(2 + keys.len() + args.len());
                raw.push(Value::from(body));
                raw.push(Value::Integer(keys.len() as i64));
                raw.extend(keys.iter().map(|k| Value::Bytes(k.as_bytes().to_vec().into())));
                raw.extend(args.iter().cloned());
                let _: () = p
                    .custom(CustomCommand::new_static(name, slot, false), raw)
                    .await?;
                p.last::<Value>().await
            } else {
                match script {
                    Script::Sha(sha) => client.evalsha(sha, keys.clone(), args.clone()).await,
                    Script::Text(text) => client.eval(text, keys.clone(), args.clone()).await,
                }
            };
            let e = match reply {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            match redirect(&e) {
                Some(Redirect::Moved(server) | Redirect::Ask(server)) => {
                    let asking = matches!(redirect(&e), Some(Redirect::Ask(_)));
                    if !asking {
                        self.refresh_soon();
                    }
                    redirections += 1;
                    if redirections >= MAX_REDIRECTIONS {
                        // While a slot's move is set on one node and not yet on the other, the
                        // two send a call back and forth with MOVED: wait as for TRYAGAIN,
                        // within the same time.
                        if started.elapsed() >= TRY_AGAIN_FOR {
                            return Err(e);
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(TRY_AGAIN_MAX);
                        redirections = 0;
                    }
                    to = Some((server, asking));
                }
                Some(Redirect::TryAgain | Redirect::Down) if started.elapsed() < TRY_AGAIN_FOR => {
                    if matches!(redirect(&e), Some(Redirect::Down)) {
                        self.refresh_soon();
                    }
                    // A half-moved slot answers ASK and then TRYAGAIN until it is moved (a
                    // script's page is there, the bucket's key of the layout before pages never
                    // is): the time bound, not the count, ends that loop.
                    redirections = 0;
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(TRY_AGAIN_MAX);
                }
                Some(_) => return Err(e),
                None => {
                    if matches!(e.kind(), ErrorKind::IO | ErrorKind::Timeout | ErrorKind::Canceled) {
                        self.refresh_soon();
                    }
                    return Err(e);
                }
            }
        }
    }

    /// `SCRIPT LOAD` on every primary in the map.
    pub(crate) async fn load(&self, script: &str) -> Result<(), FredError> {
        let pools: Vec<Pool> = {
            let map = self.map.read().unwrap_or_else(|p| p.into_inner());
            map.primaries.values().cloned().collect()
        };
        if pools.is_empty() {
            return Err(unreachable("no cluster node is connected".into()));
        }
        for pool in pools {
            pool.script_load::<(), _>(script).await?;
        }
        Ok(())
    }

    /// Hash slots the map gives no primary: 0 on a cluster with full coverage.
    pub(crate) fn uncovered(&self) -> u32 {
        let map = self.map.read().unwrap_or_else(|p| p.into_inner());
        let covered: u32 = map
            .routing
            .slots()
            .iter()
            .map(|r| u32::from(r.end) - u32::from(r.start) + 1)
            .sum();
        16_384u32.saturating_sub(covered)
    }

    /// Every primary in the map, with its pool.
    pub(crate) fn primaries(&self) -> Vec<(Server, Pool)> {
        let map = self.map.read().unwrap_or_else(|p| p.into_inner());
        let mut all: Vec<(Server, Pool)> = map
            .primaries
            .iter()
            .map(|(s, p)| (s.clone(), p.clone()))
            .collect();
        all.sort_by(|a, b| (&a.0.host, a.0.port).cmp(&(&b.0.host, b.0.port)));
        all
    }

    pub(crate) async fn quit(&self) {
        let pools: Vec<Pool> = {
            let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
            map.primaries.drain().map(|(_, p)| p).collect()
        };
        for pool in pools {
            let _ = pool.quit().await;
        }
    }
}

async fn slots_of(pool: &Pool, server: &Server) -> Result<ClusterRouting, FredError> {
    let value: Value = match tokio::time::timeout(REFRESH_TIMEOUT, pool.cluster_slots()).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(unreachable(format!(
                "cluster node {server} did not answer CLUSTER SLOTS"
            )));
        }
    };
    ClusterRouting::from_cluster_slots(unknown_hosts_as_null(value), server.host.clone())
}

/// Redis answers an empty host for a node that has not learned its own address (a cluster of
/// one node that never met another); the address to use is then the one asked. fred takes that
/// address for a null host only, so an empty one becomes null before it parses the map.
fn unknown_hosts_as_null(value: Value) -> Value {
    let Value::Array(ranges) = value else {
        return value;
    };
    let node = |n: Value| match n {
        Value::Array(mut block) => {
            if let Some(first) = block.first_mut()
                && matches!(first.as_str().as_deref(), Some("") | Some("?"))
            {
                *first = Value::Null;
            }
            Value::Array(block)
        }
        other => other,
    };
    let range = |r: Value| match r {
        // [start, end, primary, replica...]
        Value::Array(items) => Value::Array(
            items
                .into_iter()
                .enumerate()
                .map(|(i, v)| if i >= 2 { node(v) } else { v })
                .collect(),
        ),
        other => other,
    };
    Value::Array(ranges.into_iter().map(range).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirections_are_read_from_the_error() {
        let e = |s: &str| FredError::new(ErrorKind::Cluster, s.to_string());
        assert!(matches!(
            redirect(&e("MOVED 3999 127.0.0.1:6381")),
            Some(Redirect::Moved(s)) if s.port == 6381 && &*s.host == "127.0.0.1"
        ));
        assert!(matches!(redirect(&e("ASK 12 10.0.0.2:7000")), Some(Redirect::Ask(s)) if s.port == 7000));
        assert!(matches!(
            redirect(&e("TRYAGAIN Multiple keys request during rehashing of slot")),
            Some(Redirect::TryAgain)
        ));
        assert!(matches!(
            redirect(&e("CLUSTERDOWN Hash slot not served")),
            Some(Redirect::Down)
        ));
        assert!(redirect(&e("NOSCRIPT No matching script")).is_none());
        assert!(redirect(&e("MOVED garbage")).is_none());
    }

    #[test]
    fn a_node_that_does_not_know_its_address_is_the_one_asked() {
        let block = |host: &str, port: i64, id: &str| {
            Value::Array(vec![host.into(), port.into(), id.into(), Value::Array(vec![])])
        };
        // What a one-node cluster answers, and a known node beside it.
        let value = Value::Array(vec![
            Value::Array(vec![0.into(), 8191.into(), block("", 7001, "a")]),
            Value::Array(vec![8192.into(), 16383.into(), block("10.0.0.9", 7002, "b")]),
        ]);
        let routing =
            ClusterRouting::from_cluster_slots(unknown_hosts_as_null(value), "127.0.0.1").expect("parses");
        let primaries: Vec<String> = routing
            .slots()
            .iter()
            .map(|r| format!("{}:{}", r.primary.host, r.primary.port))
            .collect();
        assert_eq!(primaries, ["127.0.0.1:7001", "10.0.0.9:7002"]);
    }
}
