//! The command line and the configuration it makes: every flag also reads a `TOLLGATE_*`
//! environment variable, every value is validated, and `CommonArgs::gateway_config` turns them
//! into the [`GatewayConfig`] start-up takes, before anything starts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use tollgate_limit::clock::{Clock, SystemClock};
use tollgate_rules::identity::TrustedProxies;
use tollgate_rules::{RulesError, RulesSource};

use crate::regions::RegionsConfig;
use crate::server::{ServerLimits, tls};
pub use crate::store_url::StoreUrl;
pub use tollgate_limit::clock::parse_duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

/// Whose clock a shared store's check reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum ClockSource {
    /// The store's own TIME: one clock for the whole fleet.
    #[default]
    Store,
    /// The calling gateway's clock, passed to the script: clock skew between gateways refills
    /// buckets early, by as much as the clocks disagree (README "`--clock gateway`").
    Gateway,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The rules file (JSON).
    #[arg(long, env = "TOLLGATE_RULES")]
    pub rules: PathBuf,
    #[command(flatten)]
    pub common: CommonArgs,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// A rules file of your own instead of the built-in rules/demo.json; it is hot-reloaded.
    #[arg(long, env = "TOLLGATE_RULES")]
    pub rules: Option<PathBuf>,
    /// Run this many instances of the demo upstream (1 to 9), each a target of every upstream
    /// and answering with its name; `POST /admin/demo/instances/NAME/stop` (and `start`) on the
    /// admin listener stops one, to watch the gateway route around it.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=crate::demo_instances::MAX_INSTANCES as i64))]
    pub targets: u32,
    #[command(flatten)]
    pub common: CommonArgs,
}

fn parse_lines(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1 line".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?} is not a number of lines: {e}")),
    }
}

/// Access lines that may wait for the log writer: about 20 MB of lines, a few seconds of a
/// busy gateway's output.
pub const DEFAULT_ACCESS_BUFFER: usize = 65_536;

/// Where the store is and how to reach it: `serve`, `demo` and `check-store` take these.
#[derive(Debug, Args, Clone)]
pub struct StoreArgs {
    /// `memory` (embedded), `redis://HOST:PORT`, `redis-cluster://H1:P1,H2:P2` or
    /// `redis-sentinel://S1:P1,S2:P2/SERVICE`; over TLS `rediss://`, `rediss-cluster://`,
    /// `rediss-sentinel://` (`valkey://` and `valkeys://` too).
    #[arg(
        id = "store",
        long = "store",
        env = "TOLLGATE_STORE",
        default_value = "memory"
    )]
    pub url: String,
    /// PEM CA certificates a TLS store's certificate must chain to; the built-in roots
    /// (Mozilla's) without.
    #[arg(id = "store_ca", long = "store-ca", env = "TOLLGATE_STORE_CA")]
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain, for a TLS store that asks for one.
    #[arg(
        id = "store_cert",
        long = "store-cert",
        env = "TOLLGATE_STORE_CERT",
        requires = "store_key"
    )]
    pub cert: Option<PathBuf>,
    /// PEM private key for --store-cert.
    #[arg(
        id = "store_key",
        long = "store-key",
        env = "TOLLGATE_STORE_KEY",
        requires = "store_cert"
    )]
    pub key: Option<PathBuf>,
    /// The name a TLS store's certificate must carry, where the URL's host is not that name.
    #[arg(
        id = "store_server_name",
        long = "store-server-name",
        env = "TOLLGATE_STORE_SERVER_NAME"
    )]
    pub server_name: Option<String>,
    /// The store's ACL user (or put it in the URL).
    #[arg(
        id = "store_username",
        long = "store-username",
        env = "TOLLGATE_STORE_USERNAME"
    )]
    pub username: Option<String>,
    /// A file whose first line is the store's password, read at start and again on SIGHUP:
    /// out of `ps` and the environment, and rotated without a restart.
    #[arg(
        id = "store_password_file",
        long = "store-password-file",
        env = "TOLLGATE_STORE_PASSWORD_FILE"
    )]
    pub password_file: Option<PathBuf>,
}

#[derive(Debug, Args, Clone)]
pub struct CommonArgs {
    /// Public listener.
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Admin listener (/healthz, /readyz, /metrics, /admin/rules); off when unset.
    #[arg(long, env = "TOLLGATE_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// A host name the admin listener's `/admin/` pages and API answer to, besides IP
    /// literals and `localhost` (repeat, or separate with commas). Any other `Host` gets 421.
    #[arg(long = "admin-host", env = "TOLLGATE_ADMIN_HOST", value_delimiter = ',')]
    pub admin_hosts: Vec<String>,
    #[command(flatten)]
    pub store: StoreArgs,
    /// How long one check may wait for a remote store before its failure policy decides.
    #[arg(long, env = "TOLLGATE_STORE_TIMEOUT", default_value = "3ms", value_parser = parse_duration)]
    pub store_timeout: Duration,
    /// Gateways in the fleet, for local shares (r/N) while the store is down; learned from the
    /// store's heartbeat when unset.
    #[arg(long, env = "TOLLGATE_FLEET_SIZE", value_parser = clap::value_parser!(u32).range(1..))]
    pub fleet_size: Option<u32>,
    /// Whose clock refills Redis buckets: `store` (the store's TIME, inside the check script) or
    /// `gateway` (each gateway passes its own time; only for stores that refuse TIME in scripts:
    /// gateways whose clocks differ then hand out extra tokens, see README "Redis store").
    #[arg(long, env = "TOLLGATE_CLOCK", value_enum, default_value_t = ClockSource::Store)]
    pub clock: ClockSource,
    /// PEM certificate chain; enables TLS (h2 and http/1.1 by ALPN).
    #[arg(long, env = "TOLLGATE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, env = "TOLLGATE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Proxies whose X-Forwarded-For is believed (addresses or CIDRs, comma-separated); with
    /// --proxy-protocol, the peers that must start each connection with a PROXY header.
    #[arg(long, env = "TOLLGATE_TRUSTED_PROXY", value_delimiter = ',')]
    pub trusted_proxy: Vec<String>,
    /// Take PROXY protocol v1 and v2 headers on the public listener, as an L4 load balancer
    /// (AWS NLB, HAProxy in TCP mode) sends them: from a --trusted-proxy peer the header is
    /// required and names the client; a connection from anyone else that sends one is closed,
    /// one that doesn't is served as its peer.
    #[arg(long, env = "TOLLGATE_PROXY_PROTOCOL", requires = "trusted_proxy")]
    pub proxy_protocol: bool,
    /// Threads serving connections, each accepting on a listener of its own on the same port
    /// (SO_REUSEPORT) and serving what it accepts to the end (default: one per CPU).
    #[arg(long, env = "TOLLGATE_THREADS", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// Log format.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,
    /// Access lines waiting for the log writer, at most; past this a line is dropped and
    /// counted (`tollgate_access_lines_dropped_total`) rather than making its request wait.
    #[arg(long, env = "TOLLGATE_ACCESS_LOG_BUFFER", default_value_t = DEFAULT_ACCESS_BUFFER, value_parser = parse_lines)]
    pub access_log_buffer: usize,
    /// Access lines as `json` (one object per line) or `combined` (nginx's combined format and
    /// Tollgate's fields after it), written to stderr whatever `--log-format` says; unset, an
    /// access line is a log event like any other, in `--log-format` (README "Access log
    /// formats").
    #[arg(long, env = "TOLLGATE_ACCESS_LOG_FORMAT", value_enum)]
    pub access_log_format: Option<crate::access::AccessLogFormat>,
    /// After SIGTERM or SIGINT, how long /readyz answers 503 while the gateway still serves,
    /// before its listener stops: time for a load balancer or Kubernetes to stop sending it
    /// new connections. A second signal cuts it short.
    #[arg(long, env = "TOLLGATE_SHUTDOWN_DELAY", default_value = "0s", value_parser = parse_duration)]
    pub shutdown_delay: Duration,
    /// How long to finish requests in flight after SIGTERM or SIGINT (after --shutdown-delay).
    #[arg(long, env = "TOLLGATE_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// After the requests in flight have finished, how long connections upgraded to WebSocket
    /// (a route's "upgrade") may stay open to end by themselves; those still open are then
    /// closed.
    #[arg(long, env = "TOLLGATE_UPGRADE_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub upgrade_grace: Duration,
    /// A client must send its whole request head within this time, from its first byte.
    #[arg(long, env = "TOLLGATE_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub header_timeout: Duration,
    /// A client connection with no request in flight and nothing read for this long is closed
    /// (HTTP/1 and HTTP/2, every listener; HTTP/2 gets GOAWAY first). Above the 60 s idle
    /// timeout of common cloud load balancers, so a balancer never reuses a connection the
    /// gateway is just closing.
    #[arg(long, env = "TOLLGATE_IDLE_TIMEOUT", default_value = "75s", value_parser = parse_positive_duration)]
    pub idle_timeout: Duration,
    /// A hosts(5) file (an address, then names) that answers upstream target names before the
    /// system's resolver; read again when it changes. A name with several lines is that many
    /// targets.
    #[arg(long, env = "TOLLGATE_HOSTS_FILE")]
    pub hosts_file: Option<PathBuf>,
    /// A client must send each next piece of a request body within this time; past it, 408.
    #[arg(long, env = "TOLLGATE_BODY_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub body_timeout: Duration,
    /// Largest request head, in bytes; larger gets 431.
    #[arg(long, env = "TOLLGATE_MAX_HEADER_BYTES", default_value_t = 32 * 1024)]
    pub max_header_bytes: usize,
    /// Most client connections open at once (default: no cap). When full, a new connection
    /// closes the one idle longest between requests; with none idle it is closed at once
    /// (README "Connection caps").
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: Option<u32>,
    /// Most client connections open at once from one IP (the TCP peer), the same way
    /// (default: no cap).
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS_PER_IP", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections_per_ip: Option<u32>,
    /// Serve every request through hyper's general path, without the express lane for plain
    /// HTTP/1.1 requests without a body (README "The express lane"); for comparison.
    #[arg(long, env = "TOLLGATE_NO_EXPRESS")]
    pub no_express: bool,
    /// This gateway's name in its usage records (default: the host name).
    #[arg(long, env = "TOLLGATE_INSTANCE")]
    pub instance: Option<String>,
    /// How often usage records are written (README "Metering and quotas").
    #[arg(long, env = "TOLLGATE_METER_INTERVAL", default_value = "5s", value_parser = parse_positive_duration)]
    pub meter_interval: Duration,
    /// The SQLite file that takes usage records on the embedded store.
    #[arg(long, env = "TOLLGATE_METER_FILE", default_value = "tollgate-usage.db")]
    pub meter_file: PathBuf,
    /// A file whose first line is the token the admin listener's key API asks for
    /// (`Authorization: Bearer …`, at least 16 characters). Without it the key API answers 404.
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// The SQLite file that keeps the keys made through the admin API on the embedded store
    /// (default: `tollgate-keys.db` beside the metering file); a Redis store keeps them itself.
    #[arg(long, env = "TOLLGATE_KEYS_FILE")]
    pub keys_file: Option<PathBuf>,
    /// Count nothing for billing (for comparison; quotas then see no usage from this gateway).
    #[arg(long, env = "TOLLGATE_NO_METER")]
    pub no_meter: bool,
    /// How long a seat of a limit on requests in flight (`"concurrent"`) outlives a gateway that
    /// died holding it; renewed every third of it while its request lasts.
    #[arg(long, env = "TOLLGATE_CONCURRENCY_LEASE", default_value = "30s", value_parser = parse_positive_duration)]
    pub concurrency_lease: Duration,
    /// This gateway's Region, for limits shared across Regions (README "One limit across
    /// Regions"); needs --regions.
    #[arg(long, env = "TOLLGATE_REGION", requires = "regions")]
    pub region: Option<String>,
    /// Every Region's store, `A=redis://…,B=redis://…`; this Region's is the gateway's store.
    #[arg(long, env = "TOLLGATE_REGIONS", value_delimiter = ',', requires = "region")]
    pub regions: Vec<String>,
    /// The outside health check of other Regions, `B=http://…,C=http://…`: a silent Region's
    /// share is reclaimed only when its check fails too.
    #[arg(
        long,
        env = "TOLLGATE_REGION_HEALTH",
        value_delimiter = ',',
        requires = "region"
    )]
    pub region_health: Vec<String>,
    /// How often a Region's agent moves shares.
    #[arg(long, env = "TOLLGATE_REBALANCE_INTERVAL", default_value = "5s", value_parser = parse_positive_duration)]
    pub rebalance_interval: Duration,
    /// The Region agent's lease; another gateway takes over within two of them.
    #[arg(long, env = "TOLLGATE_REGION_LEASE", default_value = "10s", value_parser = parse_positive_duration)]
    pub region_lease: Duration,
    /// How long a check in another Region's store may wait (a security limit's home Region)
    /// before the limit's failure policy decides.
    #[arg(long, env = "TOLLGATE_REGION_STORE_TIMEOUT", default_value = "100ms", value_parser = parse_positive_duration)]
    pub region_store_timeout: Duration,
    /// Export one span per request over OTLP/HTTP (protobuf) to this collector, e.g.
    /// `http://127.0.0.1:4318` (spans go to its `/v1/traces`); off when unset.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_parser = crate::otel::parse_endpoint)]
    pub otlp_endpoint: Option<String>,
    /// The share of new traces exported, 0.0 to 1.0; a caller's `traceparent` decides for its
    /// own trace by its sampled flag.
    #[arg(long, env = "TOLLGATE_OTLP_SAMPLE_RATIO", default_value = "1.0", value_parser = crate::otel::parse_ratio)]
    pub otlp_sample_ratio: f64,
}

/// The host's name, for a gateway started without `--instance`.
pub fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "tollgate".into())
}

/// A duration above zero.
pub(crate) fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d.is_zero() {
        return Err(format!("{text:?} must be above zero"));
    }
    Ok(d)
}

/// A validated configuration.
pub struct GatewayConfig {
    pub rules: RulesSource,
    pub listen: SocketAddr,
    pub admin_listen: Option<SocketAddr>,
    /// Host names the admin pages and API answer to besides IP literals and `localhost`.
    pub admin_hosts: crate::admin_guard::AdminHosts,
    /// The token the key API asks for; `None`: the key API answers 404.
    pub admin_token: Option<crate::admin_guard::AdminToken>,
    /// Where the embedded store keeps keys made through the admin API; `None`: it keeps
    /// none and the key API is off (the command line always names one).
    pub keys_file: Option<PathBuf>,
    pub store: StoreUrl,
    /// TLS and credentials for every connection to the store.
    pub store_access: tollgate_store::redis::Access,
    pub tls: Option<(PathBuf, PathBuf)>,
    pub trusted: TrustedProxies,
    pub limits: ServerLimits,
    /// Start the demo upstream and point every upstream at it.
    pub demo: bool,
    /// How many instances of the demo upstream to start, each a target of every upstream.
    pub demo_targets: u32,
    /// After the stop signal, how long `/readyz` answers 503 while everything still serves,
    /// before the public listener stops.
    pub shutdown_delay: Duration,
    /// The gateway's clock (the embedded store reads it; tests pass a manual one).
    pub clock: Arc<dyn Clock>,
    /// How long a check may wait for a remote store.
    pub store_timeout: Duration,
    /// Gateways in the fleet; learned from the store when `None`.
    pub fleet_size: Option<u32>,
    /// Whose clock a Redis store's check reads (the store's unless `--clock gateway`).
    pub clock_source: ClockSource,
    /// Metering of admitted requests for billing; off when `None`.
    pub meter: Option<MeterConfig>,
    /// Limits shared with other Regions; off when `None`.
    pub regions: Option<crate::regions::RegionsConfig>,
    /// How long a seat of a limit on requests in flight outlives a gateway that died holding it.
    pub seat_lease: Duration,
    /// A span per request over OTLP; off when `None`.
    pub otlp: Option<crate::otel::OtlpConfig>,
    /// Where access lines go in a conventional format; `None`: as `tollgate::access` events.
    pub access_log: Option<crate::access::AccessLog>,
    /// Threads that accept and serve the public listener's connections, each on a listener
    /// of its own (`server::run_shards`); 1: the caller's runtime serves them.
    pub shards: usize,
    /// A hosts(5) file that answers upstream target names before the system's resolver.
    pub hosts_file: Option<PathBuf>,
}

/// Where and how often this gateway writes its usage records.
#[derive(Debug, Clone)]
pub struct MeterConfig {
    /// This gateway's name in its records (its identity adds a boot id made at start).
    pub instance: String,
    pub interval: Duration,
    /// The SQLite file for the embedded store; a Redis store takes the records on its stream.
    pub file: PathBuf,
}

impl GatewayConfig {
    /// Defaults for a quick start on loopback: memory store, free ports, system clock.
    pub fn new(rules: RulesSource) -> GatewayConfig {
        GatewayConfig {
            rules,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_listen: None,
            admin_hosts: Default::default(),
            admin_token: None,
            keys_file: None,
            store: StoreUrl::Memory,
            store_access: Default::default(),
            tls: None,
            trusted: TrustedProxies::default(),
            limits: ServerLimits::default(),
            demo: false,
            demo_targets: 1,
            shutdown_delay: Duration::ZERO,
            clock: SystemClock::shared(),
            store_timeout: Duration::from_millis(3),
            fleet_size: None,
            clock_source: ClockSource::Store,
            meter: None,
            regions: None,
            seat_lease: Duration::from_secs(30),
            otlp: None,
            access_log: None,
            shards: 1,
            hosts_file: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Rules(#[from] RulesError),
    #[error("TLS: {0}")]
    Tls(#[from] tls::TlsError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("store: {0}")]
    Store(String),
    #[error("rules file watch: {0}")]
    Watch(String),
    #[error("metering: {0}")]
    Meter(String),
    #[error("Regions: {0}")]
    Regions(String),
    #[error("OTLP: {0}")]
    Otlp(String),
    #[error("managed keys: {0}")]
    Keys(String),
    #[error("hosts file: {0}")]
    HostsFile(String),
}

impl CommonArgs {
    /// The gateway's configuration from these flags, every value checked: the one place
    /// flags become a [`GatewayConfig`].
    pub fn gateway_config(&self, rules: RulesSource, demo: bool) -> Result<GatewayConfig, String> {
        let c = self;
        let mut cfg = GatewayConfig::new(rules);
        cfg.listen = c.listen;
        cfg.admin_listen = c.admin_listen;
        cfg.admin_hosts = crate::admin_guard::AdminHosts::new(&c.admin_hosts);
        cfg.admin_token = c
            .admin_token_file
            .as_deref()
            .map(crate::admin_guard::AdminToken::read)
            .transpose()?;
        cfg.keys_file = Some(c.keys_file.clone().unwrap_or_else(|| {
            c.meter_file
                .parent()
                .unwrap_or(std::path::Path::new(""))
                .join("tollgate-keys.db")
        }));
        cfg.store = StoreUrl::parse(&c.store.url)?;
        cfg.clock_source = c.clock;
        cfg.tls = match (&c.tls_cert, &c.tls_key) {
            (Some(cert), Some(key)) => Some((cert.clone(), key.clone())),
            _ => None,
        };
        cfg.trusted = TrustedProxies::parse(&c.trusted_proxy)?;
        cfg.limits = ServerLimits {
            header_read_timeout: c.header_timeout,
            idle_timeout: c.idle_timeout,
            body_read_timeout: c.body_timeout,
            drain_timeout: c.drain_timeout,
            upgrade_grace: c.upgrade_grace,
            max_header_bytes: c.max_header_bytes,
            express: !c.no_express,
            max_connections: c.max_connections,
            max_connections_per_ip: c.max_connections_per_ip,
            proxy_protocol: c.proxy_protocol.then(|| std::sync::Arc::new(cfg.trusted.clone())),
            ..ServerLimits::default()
        };
        cfg.demo = demo;
        cfg.hosts_file = c.hosts_file.clone();
        cfg.shutdown_delay = c.shutdown_delay;
        cfg.shards = shards(c.threads);
        cfg.store_timeout = c.store_timeout;
        cfg.fleet_size = c.fleet_size;
        cfg.seat_lease = c.concurrency_lease;
        cfg.otlp = c.otlp_endpoint.clone().map(|endpoint| crate::otel::OtlpConfig {
            endpoint,
            sample_ratio: c.otlp_sample_ratio,
        });
        cfg.meter = (!c.no_meter).then(|| MeterConfig {
            instance: c.instance.clone().unwrap_or_else(host_name),
            interval: c.meter_interval,
            file: c.meter_file.clone(),
        });
        if let Some(region) = &c.region {
            let instance = c.instance.clone().unwrap_or_else(host_name);
            let rc = RegionsConfig::parse(
                region,
                &c.regions,
                &c.region_health,
                c.rebalance_interval,
                c.region_lease,
                &instance,
            )?;
            // This Region's store is the gateway's: naming another one with --store is a mistake.
            let own = StoreUrl::parse(rc.own_store())?;
            match &cfg.store {
                StoreUrl::Memory if c.store.url == "memory" => {}
                named if *named == own => {}
                _ => {
                    return Err(format!(
                        "--store {} and --regions {}={} name two stores for this Region; leave --store out",
                        cfg.store.redacted(),
                        region,
                        rc.own_store()
                    ));
                }
            }
            cfg.store = own;
            cfg.regions = Some(RegionsConfig {
                store_timeout: c.region_store_timeout,
                ..rc
            });
        }
        // After the Regions: their own store is the one the TLS and password flags reach.
        cfg.store_access = c.store.access(&cfg.store)?;
        Ok(cfg)
    }
}

impl StoreArgs {
    /// TLS and credentials for the store from the `--store-*` flags. TLS settings on a store
    /// that doesn't speak TLS, or credentials for the embedded store, are refused: a flag that
    /// would do nothing is a mistake.
    pub fn access(&self, store: &StoreUrl) -> Result<tollgate_store::redis::Access, String> {
        use tollgate_store::redis::{Access, TlsFiles};
        let files = TlsFiles {
            ca: self.ca.clone(),
            client: self.cert.clone().zip(self.key.clone()),
            server_name: self.server_name.clone(),
        };
        let tls_asked = files.ca.is_some() || files.client.is_some() || files.server_name.is_some();
        let store_tls = match store {
            StoreUrl::Memory => false,
            StoreUrl::Redis(url) => url.starts_with("rediss://"),
            StoreUrl::RedisCluster { tls, .. } | StoreUrl::RedisSentinel { tls, .. } => *tls,
        };
        if tls_asked && !store_tls {
            return Err(format!(
                "--store-ca, --store-cert and --store-server-name need a TLS store (rediss://, valkeys:// or rediss-cluster://), not --store {}",
                store.redacted()
            ));
        }
        let creds_asked = self.username.is_some() || self.password_file.is_some();
        if creds_asked && *store == StoreUrl::Memory {
            return Err(
                "--store-username and --store-password-file need a Redis store (--store redis://…)".into(),
            );
        }
        Access::from_flags(files, self.username.clone(), self.password_file.clone())
    }
}

impl GatewayConfig {
    /// Where the Redis store is and how to reach it; `None` for the embedded store.
    pub fn store_target(&self) -> Option<tollgate_store::redis::Target<'_>> {
        self.store.target(&self.store_access)
    }
}

/// Threads that serve a gateway's connections: `--threads`, or one per CPU.
pub fn shards(threads: Option<u16>) -> usize {
    threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        usize::from,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_stores() {
        assert_eq!(parse_duration("3ms").unwrap(), Duration::from_millis(3));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("1d").is_err());
        assert_eq!(StoreUrl::parse("memory").unwrap(), StoreUrl::Memory);
        assert_eq!(
            StoreUrl::parse("redis-cluster://a:1,b:2").unwrap(),
            StoreUrl::RedisCluster {
                nodes: vec!["a:1".into(), "b:2".into()],
                tls: false
            }
        );
        assert_eq!(
            StoreUrl::parse("valkeys://u:p@h:6380/0").unwrap(),
            StoreUrl::Redis("rediss://u:p@h:6380/0".into())
        );
        assert_eq!(
            StoreUrl::parse("rediss-cluster://a:1").unwrap(),
            StoreUrl::RedisCluster {
                nodes: vec!["a:1".into()],
                tls: true
            }
        );
        assert!(StoreUrl::parse("mysql://x").is_err());
        assert_eq!(
            StoreUrl::parse("redis-sentinel://s1:26379,s2:26379/mymaster").unwrap(),
            StoreUrl::RedisSentinel {
                sentinels: vec!["s1:26379".into(), "s2:26379".into()],
                service: "mymaster".into(),
                tls: false
            }
        );
        assert!(StoreUrl::parse("redis-sentinel://s1:26379").is_err());
        assert!(StoreUrl::parse("redis-sentinel://s1/mymaster").is_err());
    }
}
