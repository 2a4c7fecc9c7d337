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
use super::{ConnectError, DEFAULT_CONNECTIONS, Place, RedisStore, Shared, StoreTls, Target};
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

    /// What the store is: its primaries, the server's name and version (from `INFO server`,
    /// which a user without `+info` may not run), and whether a script may read `TIME`.
    async fn survey(&self, sentinel: bool) -> (Vec<String>, String, bool) {
        let pools: Vec<(String, Pool)> = match self {
            // Under Sentinel, the primary the sentinels named.
            Conn::One(pool) if sentinel => {
                let at = pool.next().active_connections();
                let at = at
                    .first()
                    .map(|s| format!("{}:{}", s.host, s.port))
                    .unwrap_or_default();
                vec![(at, pool.clone())]
            }
            Conn::One(pool) => vec![(String::new(), pool.clone())],
            Conn::Cluster(nodes) => nodes
                .primaries()
                .into_iter()
                .map(|(s, p)| (format!("{}:{}", s.host, s.port), p))
                .collect(),
        };
        let primaries = pools
            .iter()
            .map(|(s, _)| s.clone())
            .filter(|s| !s.is_empty())
            .collect();
        let Some((_, pool)) = pools.first() else {
            return (primaries, "no primary connected".into(), false);
        };
        let info: Result<String, FredError> = pool.info(Some(fred::types::InfoKind::Server)).await;
        let version = match info {
            Ok(text) => server_version(&text),
            Err(e) => format!("version unknown (INFO: {})", e.details()),
        };
        let time: Result<Value, FredError> = pool
            .eval(
                "return redis.call('TIME')[1]",
                Vec::<Key>::new(),
                Vec::<Value>::new(),
            )
            .await;
        (primaries, version, time.is_ok())
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
    let mut config = match target.place {
        Place::Node(url) => {
            // fred would build TLS of its own from the scheme: the access's is used instead.
            let plain = url
                .strip_prefix("rediss://")
                .map(|rest| format!("redis://{rest}"));
            Config::from_url_centralized(plain.as_deref().unwrap_or(url))
                .map_err(|e| format!("not a usable redis:// URL: {}", e.details()))?
        }
        Place::Cluster { nodes, .. } => Config {
            server: ServerConfig::Clustered {
                hosts: servers("cluster node", nodes)?,
                policy: ClusterDiscoveryPolicy::default(),
            },
            ..Config::default()
        },
        // fred asks the sentinels for the primary at each connection, checks that it is one
        // (`ROLE`), and asks again when the connection drops: a failover is a reconnect.
        Place::Sentinel {
            sentinels, service, ..
        } => Config {
            server: ServerConfig::Sentinel {
                hosts: servers("sentinel", sentinels)?,
                service_name: service.to_string(),
            },
            ..Config::default()
        },
    };
    reach_with(&mut config, target)?;
    Ok(config)
}

/// `HOST:PORT` strings as fred's servers; `what` names them in an error.
fn servers(what: &str, list: &[String]) -> Result<Vec<Server>, String> {
    let mut hosts = Vec::with_capacity(list.len());
    for n in list {
        let (host, port) = n
            .rsplit_once(':')
            .ok_or_else(|| format!("{what} {n:?} must be HOST:PORT"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("{what} {n:?}: {port:?} is not a port number"))?;
        if host.is_empty() {
            return Err(format!("{what} {n:?} has no host"));
        }
        hosts.push(Server::new(host, port));
    }
    Ok(hosts)
}

/// Puts `target`'s TLS and credentials into `config`. A URL's password and a password file are
/// one too many: the file is the way that keeps it out of `ps`.
fn reach_with(config: &mut Config, target: Target<'_>) -> Result<(), String> {
    target.access.apply(config, target.tls())
}

/// `Redis 7.0.15` or `Valkey 8.0.1` from `INFO server`'s text.
fn server_version(info: &str) -> String {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
    };
    match (field("valkey_version:"), field("redis_version:")) {
        (Some(v), _) => format!("Valkey {v}"),
        (None, Some(v)) => format!("Redis {v}"),
        (None, None) => "version unknown".into(),
    }
}

/// Whether a store's answer is an ACL refusal.
fn denied(reason: &str) -> bool {
    reason.contains("NOPERM")
        || reason.contains("can't run this command")
        || reason.contains("no permissions")
}

/// Whether `version` (from [`server_version`]) is a Redis before 5.0.
fn too_old(version: &str) -> bool {
    version
        .strip_prefix("Redis ")
        .and_then(|v| v.split('.').next())
        .and_then(|major| major.parse::<u32>().ok())
        .is_some_and(|major| major < 5)
}

/// What start-up found of the store, said in one line and by `tollgate check-store`.
#[derive(Debug, Clone)]
pub struct Found {
    /// `redis` or `redis-cluster`.
    pub kind: &'static str,
    /// The URL, its password replaced.
    pub place: String,
    /// A cluster's primaries as `HOST:PORT`; empty for one node.
    pub primaries: Vec<String>,
    pub tls: bool,
    pub user: String,
    /// `Redis 7.0.15`, `Valkey 8.0.1`, or why it is unknown.
    pub version: String,
    /// Whether a script may read `TIME`: the store's clock needs it.
    pub time_in_scripts: bool,
    /// A cluster's hash slots that no primary serves: their checks follow the failure
    /// policies until one does.
    pub uncovered_slots: u32,
}

impl std::fmt::Display for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at {}", self.kind, self.place)?;
        match self.primaries.as_slice() {
            [] => {}
            [one] => write!(f, " (primary {one})")?,
            all => write!(f, " ({} primaries: {})", all.len(), all.join(", "))?,
        }
        write!(
            f,
            "; {}; user {}; {}; TIME in scripts {}",
            if self.tls { "TLS" } else { "plain TCP" },
            self.user,
            self.version,
            if self.time_in_scripts {
                "allowed"
            } else {
                "refused"
            }
        )?;
        if self.uncovered_slots > 0 {
            write!(f, "; {} hash slots without a primary", self.uncovered_slots)?;
        }
        Ok(())
    }
}

/// Why a first connection failed. A certificate that does not check out or credentials the
/// store refuses stop start-up; only a store that doesn't answer is waited for.
fn why_not_connected(store: String, e: &FredError) -> ConnectError {
    let reason = e.details().to_string();
    let lower = reason.to_ascii_lowercase();
    let tls_words = [
        "certificate",
        "tls",
        "handshake",
        "alert",
        "peer sent no certificates",
        "server name",
    ];
    if *e.kind() == ErrorKind::Auth
        || lower.contains("wrongpass")
        || lower.contains("noauth")
        || lower.contains("noperm")
    {
        ConnectError::Auth { store, reason }
    } else if *e.kind() == ErrorKind::Tls || tls_words.iter().any(|w| lower.contains(w)) {
        ConnectError::Tls { store, reason }
    } else {
        ConnectError::Unreachable { store, reason }
    }
}

/// The user a node's URL names, if any.
fn url_user(target: Target<'_>) -> Option<String> {
    let Place::Node(url) = target.place else {
        return None;
    };
    let rest = url.split_once("://")?.1;
    let (auth, _) = rest.rsplit_once('@')?;
    let user = auth.split_once(':').map_or(auth, |(u, _)| u);
    (!user.is_empty()).then(|| user.to_string())
}

fn kind_of(target: Target<'_>) -> (&'static str, bool) {
    match target.place {
        Place::Node(_) => ("redis", false),
        Place::Cluster { .. } => ("redis-cluster", true),
        Place::Sentinel { .. } => ("redis-sentinel", false),
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
            let tls = match target.tls() {
                true => Some(
                    target
                        .access
                        .tls_or_roots()
                        .map_err(|e| bad(e.details().to_string()))?,
                ),
                false => None,
            };
            let (username, password, credentials) = (
                config.username.clone(),
                config.password.clone(),
                config.credential_provider.clone(),
            );
            let make = move |server: &Server| {
                // Each primary as one node, reached as the seeds are.
                let config = Config {
                    server: ServerConfig::Centralized {
                        server: match &tls {
                            Some(t) => t.server(server),
                            None => server.clone(),
                        },
                    },
                    tls: tls.as_ref().map(StoreTls::fred),
                    username: username.clone(),
                    password: password.clone(),
                    credential_provider: credentials.clone(),
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
            let sentinel = matches!(config.server, ServerConfig::Sentinel { .. });
            let policy = if sentinel {
                // Each try asks the sentinels anew: the promoted replica is found within
                // 100 ms of their naming it.
                ReconnectPolicy::new_constant(0, 100)
            } else if fail_fast {
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
            return Err(why_not_connected(name, &e));
        }
        let shared = Shared::new(client, clock, cluster, name);
        let fail = |e: FredError, shared: &Shared| {
            let (store, reason) = (shared.name.clone(), e.details().to_string());
            match e.kind() {
                ErrorKind::Timeout | ErrorKind::IO | ErrorKind::Canceled => {
                    ConnectError::Unreachable { store, reason }
                }
                // An ACL user without a command the script calls: the user's fault, not TIME's.
                _ if denied(&reason) => ConnectError::NoPermission { store, reason },
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
            let (store, reason) = (shared.name.clone(), e.details().to_string());
            if denied(&reason) {
                return Err(ConnectError::NoPermission { store, reason });
            }
            return Err(ConnectError::ScriptLoad { store, reason });
        }
        if let Err(e) = shared.probe().await {
            shared.client.quit().await;
            return Err(fail(e, &shared));
        }
        let sentinel = matches!(target.place, Place::Sentinel { .. });
        let (primaries, version, time_in_scripts) = shared.client.survey(sentinel).await;
        if too_old(&version) {
            shared.client.quit().await;
            return Err(ConnectError::TooOld {
                store: shared.name.clone(),
                version,
            });
        }
        let found = Found {
            kind,
            place: shared.name.clone(),
            primaries,
            tls: target.tls(),
            user: target.access.user(url_user(target).as_deref()),
            version,
            time_in_scripts,
            uncovered_slots: match &shared.client {
                Conn::Cluster(nodes) => nodes.uncovered(),
                Conn::One(_) => 0,
            },
        };
        let mut store = RedisStore::start(shared, kind);
        store.found = Some(found);
        Ok(store)
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
        RedisStore {
            shared,
            queue,
            kind,
            found: None,
        }
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

#[cfg(test)]
mod tests {
    use super::{server_version, too_old, why_not_connected};
    use fred::prelude::{Error as FredError, ErrorKind};

    #[test]
    fn the_version_is_read_from_info_and_old_ones_are_refused() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n";
        assert_eq!(server_version(info), "Redis 7.0.15");
        let valkey = "# Server\r\nredis_version:7.2.4\r\nvalkey_version:8.0.1\r\n";
        assert_eq!(server_version(valkey), "Valkey 8.0.1");
        assert_eq!(server_version("nothing"), "version unknown");
        assert!(too_old("Redis 4.0.9"));
        assert!(!too_old("Redis 5.0.0"));
        assert!(!too_old("Valkey 8.0.1"));
        assert!(!too_old("version unknown (INFO: NOPERM)"));
    }

    #[test]
    fn a_first_connection_fails_for_a_reason_of_its_kind() {
        let why =
            |kind, text: &'static str| why_not_connected("s".into(), &FredError::new(kind, text)).to_string();
        assert!(why(ErrorKind::Auth, "WRONGPASS invalid").contains("(auth)"));
        assert!(
            why(ErrorKind::IO, "invalid peer certificate: UnknownIssuer")
                .starts_with("TLS to the Redis store")
        );
        assert!(why(ErrorKind::IO, "Connection refused").starts_with("cannot connect"));
    }
}
