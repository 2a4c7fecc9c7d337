//! Start-up and the connections: fred's configuration from a `--store` target, one pool for a
//! node or a client per primary of a cluster, the checks that the store answers and can run
//! the scripts before the gateway starts, and the side client for work beside the limiter.

use std::sync::Arc;
use std::time::Duration;

use fred::prelude::{
    Builder, ClientLike, Config, ConnectionConfig, Error as FredError, ErrorKind, Key, LuaInterface,
    PerformanceConfig, Pool, ReconnectPolicy, Server, ServerConfig, TcpConfig, Value,
};
use fred::types::config::ClusterDiscoveryPolicy;
use tokio::sync::mpsc;

use super::check::run_queue;
use super::{ConnectError, DEFAULT_CONNECTIONS, RedisStore, Shared, Target};
use crate::nodes::{Nodes, Script};
use tollgate_limit::clock::Clock;

/// How long a new connection may take before start-up gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A bound on one call, so a store that stops answering gives a `StoreError::Timeout` rather
/// than a request that hangs. The failure guard sets the real, much shorter, budget.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// The connections: one node's, or a cluster's primaries each on its own client.
pub(super) enum Conn {
    One(Pool),
    Cluster(Arc<Nodes>),
}

impl Conn {
    pub(super) async fn run(
        &self,
        script: Script<'_>,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Result<Value, FredError> {
        match self {
            Conn::One(pool) => match script {
                Script::Sha(sha) => pool.evalsha(sha, keys, args).await,
                Script::Text(text) => pool.eval(text, keys, args).await,
            },
            Conn::Cluster(nodes) => nodes.run(script, keys, args).await,
        }
    }

    pub(super) async fn load(&self, script: &str) -> Result<(), FredError> {
        match self {
            Conn::One(pool) => pool.script_load_cluster::<(), _>(script).await,
            Conn::Cluster(nodes) => nodes.load(script).await,
        }
    }

    pub(super) async fn quit(&self) {
        match self {
            Conn::One(pool) => {
                let _ = pool.quit().await;
            }
            Conn::Cluster(nodes) => nodes.quit().await,
        }
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
        crate::page::prepare();
        if let Conn::Cluster(nodes) = &shared.client {
            nodes.spawn_refresher();
        }
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(run_queue(shared.clone(), rx));
        RedisStore { shared, queue, kind }
    }
}

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
