//! `tollgate replay`: drives a recorded or generated trace through the gateway's own limiter
//! code on a virtual clock, and answers "what would this limit have done?" in exact numbers.
//!
//! - [`trace`]: the CSV reader (exact decimal seconds → integer µs, errors naming row/column).
//! - [`access`] and [`logs`]: the gateway's own access logs, JSON or combined, replayed under
//!   a rules file and compared with a proposed one.
//! - [`lines`]: lines of at most 64 KiB, whatever a file or a gzip stream holds.
//! - [`algorithms`]: the token bucket through `MemoryStore::check_at`, and GCRA, fixed window,
//!   sliding log, sliding counter and the queue for comparison.
//! - [`leased`]: the `lease` design, every gateway running `limit::lease` with a modelled
//!   store round trip.
//! - [`rules`]: a real rules file: routes, costs, several limits, all-or-nothing per request.
//! - [`edge`]: the `edge` design, a WAF's rate-based rule per source address in front of the
//!   gateway.
//! - [`report`]: per-key statistics, the table, `--json` and `--decisions`.
//! - [`generate`]: the retry-storm and hot-key traces.
//! - [`plot`]: `--plot`'s charts, SVG or PNG: admitted per second per design, a bucket's tokens.
//! - [`flags`]: the command line's flags and their help; [`args`]: the command, run from them.
//!
//! Nothing here reads a clock: each row's time is the only `now`. Designs: `central` is one
//! bucket per key for the fleet (one store call per request); `local` gives every gateway its
//! own full bucket; `shares` gives each gateway rate r/N and burst
//! max(1, ⌊b/N⌋); `lease` leases whole blocks from one store bucket; `edge` replaces the
//! gateway's limit with a WAF's rule per address, for comparison.

pub mod access;
pub mod algorithms;
pub mod args;
pub mod edge;
pub mod flags;
pub mod generate;
pub mod leased;
pub mod lines;
pub mod logs;
pub mod plot;
pub mod report;
pub mod rules;
pub mod trace;

use std::collections::HashMap;
use std::io::BufRead;
use std::sync::Arc;

pub use flags::ReplayArgs;

use self::algorithms::{
    Buckets, FixedWindow, Gcra, Metered, Queue, SlidingCounter, SlidingLog, Verdict, share,
};
use self::edge::{EdgeConfig, EdgeRule};
use self::leased::LeaseFleet;
use self::plot::{TokenTrace, Window};
use self::report::{EdgeSummary, KeyStats, KeySummary, Summary};
use self::rules::RulesFleet;
use self::trace::{TraceError, TraceReader, format_time_us, parse_whole};
use tollgate_limit::bucket::{BucketParams, Rate};
use tollgate_limit::lease::{LeaseConfig, auto_block};
use tollgate_rules::{RulesError, Snapshot};

/// How the fleet shares one limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Design {
    /// One bucket per key for the whole fleet, in the shared store.
    #[default]
    Central,
    /// Each gateway its own bucket with the full rate and burst: N times the limit in all.
    Local,
    /// Each gateway rate r/N and burst max(1, b/N).
    Shares,
    /// Gateways lease whole blocks of tokens from one store bucket (hot keys).
    Lease,
    /// No gateway limit: a WAF's rate-based rule in front, per source address (--edge-rule;
    /// needs an ip column).
    Edge,
}

/// How a limit counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Algorithm {
    /// The token bucket the gateway enforces.
    #[default]
    TokenBucket,
    /// GCRA: the token bucket's decisions from one stored time.
    Gcra,
    /// N per window of P, windows aligned on multiples of P from time 0.
    FixedWindow,
    /// At most N admitted in (now − P, now].
    SlidingLog,
    /// This window's count plus the previous window's, weighted.
    SlidingCounter,
    /// Released at the rate, one every P/N, with up to --queue waiting (nginx's limit_req with
    /// a burst and no nodelay).
    Queue,
}

impl Design {
    pub fn name(self) -> &'static str {
        match self {
            Design::Central => "central",
            Design::Local => "local",
            Design::Shares => "shares",
            Design::Lease => "lease",
            Design::Edge => "edge",
        }
    }
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token-bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::FixedWindow => "fixed-window",
            Algorithm::SlidingLog => "sliding-log",
            Algorithm::SlidingCounter => "sliding-counter",
            Algorithm::Queue => "queue",
        }
    }

    fn is_window(self) -> bool {
        matches!(
            self,
            Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingCounter
        )
    }
}

/// The limit being replayed.
#[derive(Clone, Debug)]
pub enum LimitSpec {
    /// One limit per key: `--rate N/P` and (for bucket algorithms) `--burst B`.
    Single { rate: Rate, burst: Option<u64> },
    /// A compiled rules file.
    Rules(Arc<Snapshot>),
    /// The edge design's rule, which replaces the gateway's limit.
    Edge(EdgeConfig),
}

/// Everything a replay needs besides the trace.
#[derive(Clone, Debug)]
pub struct Settings {
    pub limit: LimitSpec,
    pub design: Design,
    pub algorithm: Algorithm,
    pub gateways: u64,
    /// Seeds the lease design's jitter.
    pub seed: u64,
    /// Modelled store round trip for lease calls, µs.
    pub lease_rtt_us: u64,
    /// Lease block size; `None` for the automatic `max(10, ⌈0.25 s × r / N⌉)`.
    pub lease_block: Option<u64>,
    /// Only intervals starting at or after this time count for `worst_excess`.
    pub excess_from_us: Option<u64>,
    /// `--algorithm queue`: how many may wait behind the request being released.
    pub queue: Option<u64>,
}

impl Settings {
    /// One limit, central token bucket, a fleet of 20 gateways, seed 1, 1 ms round trip.
    pub fn single(rate: Rate, burst: Option<u64>) -> Settings {
        Settings {
            limit: LimitSpec::Single { rate, burst },
            design: Design::Central,
            algorithm: Algorithm::TokenBucket,
            gateways: 20,
            seed: 1,
            lease_rtt_us: 1_000,
            lease_block: None,
            excess_from_us: None,
            queue: None,
        }
    }

    /// The edge design with this rule.
    pub fn edge(cfg: EdgeConfig) -> Settings {
        Settings {
            limit: LimitSpec::Edge(cfg),
            design: Design::Edge,
            ..Settings::single(cfg.rule, None)
        }
    }
}

/// A problem with one row, before the file and line are known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("column {column}: {reason}")]
pub struct RowError {
    pub column: &'static str,
    pub reason: String,
}

impl RowError {
    pub fn new(column: &'static str, reason: impl Into<String>) -> RowError {
        RowError {
            column,
            reason: reason.into(),
        }
    }
}

/// Why a replay can't run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    #[error("{flag}: {reason}")]
    Setting { flag: &'static str, reason: String },
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(transparent)]
    Rules(#[from] RulesError),
    #[error("{what}: {reason}")]
    Io { what: String, reason: String },
    #[error("{file}: {reason}")]
    Input { file: String, reason: String },
    /// `--max-newly-refused` was passed: the proposal is held back. Not a failure to run.
    #[error("{0}")]
    Held(String),
}

impl ReplayError {
    /// The process's exit status for it: 3 when a proposal is held back, so a script can tell
    /// it from a replay that could not run (1).
    pub fn exit_code(&self) -> i32 {
        match self {
            ReplayError::Held(_) => 3,
            _ => 1,
        }
    }
}

fn setting(flag: &'static str, reason: impl Into<String>) -> ReplayError {
    ReplayError::Setting {
        flag,
        reason: reason.into(),
    }
}

/// One request of a trace.
#[derive(Clone, Copy, Debug, Default)]
pub struct Request<'a> {
    pub time_us: u64,
    pub key: &'a str,
    /// 0-based; `None` assigns gateways round-robin over all rows, starting at 0.
    pub gateway: Option<u64>,
    /// Tokens; `None` is 1. Must be `None` with `--rules`, whose routes set costs.
    pub cost: Option<u64>,
    /// With `--rules`: what the upstream's answer reported for the route's post-paid limits
    /// (their `cost_from_response` header); `None` when it said nothing, so the reserve is the
    /// whole cost.
    pub cost_after: Option<u64>,
    pub method: Option<&'a [u8]>,
    pub path: Option<&'a [u8]>,
    pub ip: Option<&'a [u8]>,
    /// The connection's client fingerprint as an access line has it (`none`, `unparsed` or 16
    /// hex digits), for rules with fingerprint limits.
    pub fingerprint: Option<&'a [u8]>,
}

enum Engine {
    Buckets(Buckets),
    Gcra(Metered<Gcra>),
    Fixed(Metered<FixedWindow>),
    Log(Metered<SlidingLog>),
    Counter(Metered<SlidingCounter>),
    Queue(Metered<Queue>),
    // Boxed: one engine per replay, and the others stay small.
    Lease(Box<LeaseFleet>),
    Rules(Box<RulesFleet>),
    Edge(Box<EdgeRule>),
}

struct KeyEntry {
    name: Box<str>,
    stats: KeyStats,
    /// With `--rules`: the key's index and the limit its excess follows.
    rules_key: Option<usize>,
    excess_limit: Option<u16>,
}

/// The one bucket whose tokens `--plot-tokens` draws.
struct TokenProbe {
    key: Box<str>,
    /// Set once the key's first row arrives.
    key_index: Option<u32>,
    /// The gateway whose bucket it is, for designs with one bucket per gateway.
    gateway: u64,
    trace: TokenTrace,
}

/// A replay in progress: feed it rows in time order with [`Replay::check`].
pub struct Replay {
    design: Design,
    algorithm: Algorithm,
    gateways: u64,
    excess_from: u64,
    limit_text: String,
    engine: Engine,
    per_gateway: bool,
    /// The single limit's rate, for the excess statistic.
    rate: Option<Rate>,
    key_ids: HashMap<Box<str>, u32>,
    keys: Vec<KeyEntry>,
    rows: u64,
    first_time: Option<u64>,
    last_time: Option<u64>,
    /// Store calls of the central meters and buckets; the lease and rules engines count their own.
    store_calls: u64,
    tokens: Option<TokenProbe>,
}

impl Replay {
    /// Validates the settings and sets up the engine.
    pub fn new(s: Settings) -> Result<Replay, ReplayError> {
        if s.gateways == 0 {
            return Err(setting("--gateways", "must be at least 1"));
        }
        if s.gateways > u32::MAX as u64 {
            return Err(setting("--gateways", "at most 4294967295"));
        }
        if s.lease_block.is_some() && s.design != Design::Lease {
            return Err(setting(
                "--lease-block",
                "only means something with --design lease",
            ));
        }
        if s.queue.is_some() && s.algorithm != Algorithm::Queue {
            return Err(setting("--queue", "only means something with --algorithm queue"));
        }
        let per_gateway = matches!(s.design, Design::Local | Design::Shares);
        let (engine, rate, limit_text) = match &s.limit {
            LimitSpec::Edge(cfg) => {
                if s.design != Design::Edge {
                    return Err(setting(
                        "--edge-rule",
                        format!(
                            "is the edge design's limit; {} needs --rate or --rules",
                            s.design.name()
                        ),
                    ));
                }
                if cfg.check_us == 0 {
                    return Err(setting("--edge-check", "must be above zero, such as 10s"));
                }
                if cfg.delay_us == 0 {
                    return Err(setting(
                        "--edge-delay",
                        "must be above zero: a check counts the requests of its own instant, so it can act only after them",
                    ));
                }
                (Engine::Edge(Box::new(EdgeRule::new(*cfg))), None, cfg.describe())
            }
            _ if s.design == Design::Edge => {
                return Err(setting(
                    "--edge-rule",
                    "required with --design edge: the rule's N requests per trailing window W from one address, such as 3000/60s",
                ));
            }
            LimitSpec::Rules(snap) => {
                if s.algorithm != Algorithm::TokenBucket {
                    return Err(setting(
                        "--algorithm",
                        format!(
                            "--rules replays the gateway's token buckets; {} needs --rate instead",
                            s.algorithm.name()
                        ),
                    ));
                }
                if s.design == Design::Lease {
                    return Err(setting(
                        "--design",
                        "lease with --rules is not supported yet; replay the hot key with --rate and --burst",
                    ));
                }
                (
                    Engine::Rules(Box::new(RulesFleet::new(snap.clone(), s.design, s.gateways))),
                    None,
                    format!("rules {}", snap.source),
                )
            }
            LimitSpec::Single { rate, burst } => {
                let rate = *rate;
                let text = match burst {
                    Some(b) => format!("{rate} burst {b}"),
                    None => format!("{rate}"),
                };
                (Self::engine(&s, rate, *burst)?, Some(rate), text)
            }
        };
        Ok(Replay {
            design: s.design,
            algorithm: s.algorithm,
            gateways: s.gateways,
            excess_from: s.excess_from_us.unwrap_or(0),
            limit_text,
            engine,
            per_gateway,
            rate,
            key_ids: HashMap::new(),
            keys: Vec::new(),
            rows: 0,
            first_time: None,
            last_time: None,
            store_calls: 0,
            tokens: None,
        })
    }

    fn engine(s: &Settings, rate: Rate, burst: Option<u64>) -> Result<Engine, ReplayError> {
        let g = s.gateways;
        if s.algorithm.is_window() {
            if burst.is_some() {
                return Err(setting(
                    "--burst",
                    format!(
                        "{} has no burst: its limit is the N of --rate N/P per window of P",
                        s.algorithm.name()
                    ),
                ));
            }
            let limit = match s.design {
                Design::Central | Design::Local => rate.tokens,
                Design::Shares => (rate.tokens / g).max(1),
                Design::Lease => {
                    return Err(setting(
                        "--design",
                        "lease works with --algorithm token-bucket only",
                    ));
                }
                Design::Edge => unreachable!("the edge design runs its own rule"),
            };
            let period = rate.period_us;
            return Ok(match s.algorithm {
                Algorithm::FixedWindow => Engine::Fixed(Metered::new(FixedWindow { limit, period })),
                Algorithm::SlidingLog => Engine::Log(Metered::new(SlidingLog { limit, period })),
                _ => Engine::Counter(Metered::new(SlidingCounter { limit, period })),
            });
        }
        if s.algorithm == Algorithm::Queue {
            if burst.is_some() {
                return Err(setting(
                    "--burst",
                    "the queue has no burst: it releases one request every P/N and holds --queue more waiting",
                ));
            }
            let Some(queue) = s.queue else {
                return Err(setting("--queue", "required with --algorithm queue"));
            };
            let (rate, queue) = match s.design {
                Design::Shares => (share(rate, 1, g).0, queue / g),
                Design::Lease => {
                    return Err(setting(
                        "--design",
                        "lease works with --algorithm token-bucket only",
                    ));
                }
                _ => (rate, queue),
            };
            return Ok(Engine::Queue(Metered::new(Queue::new(rate, queue))));
        }
        let Some(burst) = burst else {
            return Err(setting(
                "--burst",
                format!("required with --algorithm {}", s.algorithm.name()),
            ));
        };
        let params = BucketParams::new(rate, burst).map_err(|e| setting("--rate/--burst", e.to_string()))?;
        let (rate, burst) = match s.design {
            Design::Shares => share(rate, burst, g),
            _ => (rate, burst),
        };
        let params = match s.design {
            Design::Shares => BucketParams::new(rate, burst).map_err(|e| {
                setting(
                    "--design",
                    format!(
                        "a share for {g} gateways (rate {rate}, burst {burst}) can't be computed exactly: {e}"
                    ),
                )
            })?,
            _ => params,
        };
        Ok(match (s.algorithm, s.design) {
            (Algorithm::Gcra, Design::Lease) => {
                return Err(setting(
                    "--design",
                    "lease works with --algorithm token-bucket only",
                ));
            }
            (Algorithm::Gcra, _) => Engine::Gcra(Metered::new(Gcra::new(rate, burst))),
            (_, Design::Lease) => {
                let block = s.lease_block.unwrap_or_else(|| auto_block(&params, g));
                let cfg = LeaseConfig::new(params, block, g)
                    .map_err(|e| setting("--lease-block", e.to_string()))?;
                Engine::Lease(Box::new(LeaseFleet::new(cfg, g, s.lease_rtt_us, s.seed)))
            }
            _ => Engine::Buckets(Buckets::new(params)),
        })
    }

    /// Records the tokens of `key`'s bucket (on `gateway`, for `local` and `shares`) before and
    /// after each of its checks inside `window`. Only the token bucket of `--rate` has one
    /// bucket per key whose tokens mean something alone.
    pub fn watch_tokens(&mut self, key: &str, gateway: u64, window: Window) -> Result<(), ReplayError> {
        let Engine::Buckets(b) = &self.engine else {
            let why = if matches!(self.engine, Engine::Edge(_)) {
                "draws a token bucket; the edge design counts requests per address".to_string()
            } else if matches!(self.engine, Engine::Rules(_)) {
                "draws one bucket of --rate and --burst; with --rules a request may take from several buckets"
                    .to_string()
            } else if self.design == Design::Lease {
                "draws a bucket of central, local or shares; lease splits a key's tokens among the gateways' blocks".to_string()
            } else {
                format!(
                    "draws a token bucket; --algorithm {} keeps no tokens (use token-bucket)",
                    self.algorithm.name()
                )
            };
            return Err(setting("--plot-tokens", why));
        };
        if gateway >= self.gateways {
            return Err(setting(
                "--plot-gateway",
                format!(
                    "{gateway} is not a gateway of this fleet: indexes are 0 to {} with --gateways {}",
                    self.gateways - 1,
                    self.gateways
                ),
            ));
        }
        if key.is_empty() {
            return Err(setting(
                "--plot-tokens",
                "give the key whose bucket to draw, such as k-7",
            ));
        }
        self.tokens = Some(TokenProbe {
            key: key.into(),
            key_index: self.key_ids.get(key).copied(),
            gateway,
            trace: TokenTrace::new(b.params(), window),
        });
        Ok(())
    }

    /// What `watch_tokens` recorded; `None` when not watching or the key never came.
    pub fn token_trace(&self) -> Option<&TokenTrace> {
        self.tokens
            .as_ref()
            .filter(|p| p.key_index.is_some())
            .map(|p| &p.trace)
    }

    /// Whether rows need `method` and `path` (a `--rules` replay).
    pub(crate) fn needs_routes(&self) -> bool {
        matches!(self.engine, Engine::Rules(_))
    }

    /// Whether rows need `ip` (the edge design).
    pub(crate) fn needs_ip(&self) -> bool {
        matches!(self.engine, Engine::Edge(_))
    }

    /// Whether its verdicts say how long an admitted request waited (the queue).
    pub fn waits(&self) -> bool {
        matches!(self.engine, Engine::Queue(_))
    }

    /// The edge design: when the block that refused a request ends, once that is certain. At a
    /// row's time `now` every row up to it has been checked; `None` once the trace is over.
    /// `None` for a block still on with no lift in sight, and for other designs.
    pub fn block_end(&mut self, block: u32, now: Option<u64>) -> Option<u64> {
        let last = self.last_time.unwrap_or(0);
        match &mut self.engine {
            Engine::Edge(e) => e.block_end(block, now, last),
            _ => None,
        }
    }

    fn key_index(&mut self, key: &str) -> Result<u32, RowError> {
        if let Some(&k) = self.key_ids.get(key) {
            return Ok(k);
        }
        let (rules_key, excess) = match &self.engine {
            Engine::Rules(r) => {
                let k = r.key(key)?;
                (Some(k), r.excess_limit(k))
            }
            _ => {
                if key.is_empty() {
                    return Err(RowError::new("key", "empty; every row needs a key"));
                }
                (None, None)
            }
        };
        let rate = match excess {
            Some((_, r)) => Some(r),
            None => self.rate,
        };
        let idx = self.keys.len() as u32;
        let mut stats = KeyStats::new(rate, self.excess_from);
        if matches!(self.engine, Engine::Queue(_)) {
            stats.longest_wait = Some(0);
        }
        self.keys.push(KeyEntry {
            name: key.into(),
            stats,
            rules_key,
            excess_limit: excess.map(|e| e.0),
        });
        self.key_ids.insert(key.into(), idx);
        if let Some(p) = &mut self.tokens
            && *p.key == *key
        {
            p.key_index = Some(idx);
        }
        Ok(idx)
    }

    /// Decides one row. Rows must come in time order; rows sharing a time keep their order.
    pub fn check(&mut self, r: &Request) -> Result<Verdict, RowError> {
        let now = r.time_us;
        if let Some(last) = self.last_time
            && now < last
        {
            return Err(RowError::new(
                "time",
                format!(
                    "{} is before the previous row's {}; sort the trace by time first (rows sharing a time keep their order)",
                    format_time_us(now),
                    format_time_us(last)
                ),
            ));
        }
        let gw = match r.gateway {
            Some(g) if g >= self.gateways => {
                return Err(RowError::new(
                    "gateway",
                    format!(
                        "{g} is not a gateway of this fleet: indexes are 0 to {} with --gateways {}",
                        self.gateways - 1,
                        self.gateways
                    ),
                ));
            }
            Some(g) => g,
            None => self.rows % self.gateways,
        };
        let k = self.key_index(r.key)?;
        let cost = match (r.cost, &self.engine) {
            (Some(_), Engine::Rules(_)) => {
                return Err(RowError::new(
                    "cost",
                    "with --rules the routes set every cost; drop the cost column",
                ));
            }
            (Some(0), _) => return Err(RowError::new("cost", "must be at least 1")),
            (Some(c), _) => c,
            (None, _) => 1,
        };
        let instance = if self.per_gateway {
            k as usize * self.gateways as usize + gw as usize
        } else {
            k as usize
        };
        let central = self.design == Design::Central;
        let entry = &self.keys[k as usize];
        let (verdict, tokens) = match &mut self.engine {
            Engine::Buckets(b) => {
                let name = &entry.name;
                let per_gateway = self.per_gateway;
                let probe = self
                    .tokens
                    .as_mut()
                    .filter(|p| p.key_index == Some(k) && (!per_gateway || p.gateway == gw));
                let before = probe.as_ref().map(|_| b.units_at(instance, now));
                let v = b.check(
                    instance,
                    || {
                        if per_gateway {
                            format!("rl:{{{name}}}:g{gw}")
                        } else {
                            format!("rl:{{{name}}}")
                        }
                    },
                    now,
                    cost,
                );
                if let (Some(p), Some(before)) = (probe, before) {
                    p.trace.record(now, before, b.units_at(instance, now));
                }
                (v, cost)
            }
            Engine::Gcra(m) => (m.check(instance, now, cost), cost),
            Engine::Fixed(m) => (m.check(instance, now, cost), cost),
            Engine::Log(m) => (m.check(instance, now, cost), cost),
            Engine::Counter(m) => (m.check(instance, now, cost), cost),
            Engine::Queue(m) => (m.check(instance, now, cost), cost),
            Engine::Edge(e) => {
                let ip = r.ip.filter(|ip| !ip.is_empty()).ok_or_else(|| {
                    RowError::new("ip", "empty; the edge design counts requests per source address")
                })?;
                let ip = std::str::from_utf8(ip).map_err(|_| RowError::new("ip", "not UTF-8"))?;
                (e.check(ip, now), cost)
            }
            Engine::Lease(l) => (l.check(k, gw as u32, now, cost), cost),
            Engine::Rules(f) => {
                let (Some(method), Some(path)) = (r.method, r.path) else {
                    return Err(RowError::new(
                        "method",
                        "a --rules replay needs method and path on every row",
                    ));
                };
                let key = Some(entry.rules_key.unwrap_or(0));
                let who = rules::TraceCaller {
                    ip: r.ip,
                    fingerprint: r.fingerprint,
                };
                let paid = f.check(key, method, path, who, gw, now, entry.excess_limit, r.cost_after)?;
                (paid.verdict, paid.tokens)
            }
        };
        if central && !matches!(self.engine, Engine::Rules(_) | Engine::Lease(_)) {
            self.store_calls += 1;
        }
        self.rows += 1;
        self.first_time.get_or_insert(now);
        self.last_time = Some(now);
        let stats = &mut self.keys[k as usize].stats;
        stats.record(now, verdict.admitted, tokens);
        if let (Some(w), Some(longest)) = (verdict.wait_us, &mut stats.longest_wait) {
            *longest = (*longest).max(w);
        }
        Ok(verdict)
    }

    /// The summary so far.
    pub fn summary(&self) -> Summary {
        let mut keys = std::collections::BTreeMap::new();
        let (mut admitted, mut limited) = (0, 0);
        for (i, e) in self.keys.iter().enumerate() {
            admitted += e.stats.admitted;
            limited += e.stats.limited;
            let (held, bucket) = match &self.engine {
                Engine::Lease(l) => (
                    Some(l.held(i as u32)),
                    Some(l.bucket_tokens(i as u32, self.last_time.unwrap_or(0))),
                ),
                _ => (None, None),
            };
            keys.insert(
                e.name.to_string(),
                KeySummary {
                    requests: e.stats.requests,
                    admitted: e.stats.admitted,
                    limited: e.stats.limited,
                    max_admitted_1s: e.stats.one_s.max(),
                    max_admitted_60s: e.stats.sixty_s.max(),
                    worst_excess: e.stats.excess.as_ref().and_then(|x| x.value()),
                    held_at_end: held,
                    bucket_at_end: bucket,
                    released: e.stats.longest_wait.map(|_| e.stats.admitted),
                    longest_wait_us: e.stats.longest_wait,
                },
            );
        }
        let (store_calls, grants, denials) = match &self.engine {
            Engine::Lease(l) => (l.store_calls, Some(l.grants), Some(l.denials)),
            Engine::Rules(r) => (r.store_calls, None, None),
            _ => (self.store_calls, None, None),
        };
        let waits = self.waits();
        let longest_wait_us =
            waits.then(|| keys.values().filter_map(|k| k.longest_wait_us).max().unwrap_or(0));
        let edge = match &self.engine {
            Engine::Edge(e) => Some(self.edge_summary(e)),
            _ => None,
        };
        Summary {
            requests: self.rows,
            admitted,
            limited,
            store_calls,
            keys,
            design: self.design.name().into(),
            algorithm: if edge.is_some() {
                "rate-based".into()
            } else {
                self.algorithm.name().into()
            },
            limit: self.limit_text.clone(),
            gateways: self.gateways,
            first_us: self.first_time,
            last_us: self.last_time,
            too_long_rows: 0,
            lease_grants: grants,
            lease_denials: denials,
            released: waits.then_some(admitted),
            longest_wait_us,
            edge,
        }
    }

    fn edge_summary(&self, e: &EdgeRule) -> EdgeSummary {
        let blocks = e.blocks_at_end(self.last_time.unwrap_or(0));
        let blocked = self
            .keys
            .iter()
            .filter(|k| k.stats.limited > 0)
            .map(|k| (k.name.to_string(), k.stats.limited))
            .collect();
        let passed_total = self.keys.iter().map(|k| k.stats.admitted).sum();
        EdgeSummary::new(e, &blocks, passed_total, blocked)
    }

    /// Lease design: the fleet, for tools and tests that look inside.
    pub fn lease_fleet(&self) -> Option<&LeaseFleet> {
        match &self.engine {
            Engine::Lease(l) => Some(l),
            _ => None,
        }
    }

    /// Central sliding log: what the key's log holds at `now`, without changing it.
    pub fn sliding_log_len(&self, key: &str, now: u64) -> Option<u64> {
        let k = *self.key_ids.get(key)? as usize;
        match &self.engine {
            Engine::Log(m) if !self.per_gateway => m.state(k).map(|s| s.len_at(now, m.meter.period)),
            _ => None,
        }
    }
}

/// What `run_trace` calls with each row's time and the replays' verdicts, in order, and the
/// replays themselves, for what a later row settles (when an edge block ends).
pub(crate) type OnRow<'a> = dyn FnMut(u64, &[Verdict], &mut [Replay]) -> Result<(), ReplayError> + 'a;

/// How often a long replay reports progress on stderr.
pub(crate) const PROGRESS_EVERY: u64 = 1_000_000;

/// Replays every row of a trace through each replay (one per design, all with the same
/// limit); `on_row` gets each row's time and the replays' verdicts, in trace order.
/// With `total_bytes` known, progress lines on stderr show a percentage; they start after a
/// million rows, and only when `progress` is set.
pub(crate) fn run_trace<R: BufRead>(
    replays: &mut [Replay],
    reader: &mut TraceReader<R>,
    progress: bool,
    total_bytes: Option<u64>,
    on_row: &mut OnRow<'_>,
) -> Result<u64, ReplayError> {
    let cols = reader.columns().clone();
    if replays.iter().any(Replay::needs_routes) {
        for (name, c) in [("method", cols.method), ("path", cols.path)] {
            if c.is_none() {
                return Err(TraceError::Header {
                    file: reader.file().to_string(),
                    reason: format!(
                        "a --rules replay needs a {name:?} column (and method, path, optionally ip and fingerprint)"
                    ),
                }
                .into());
            }
        }
        if cols.cost.is_some() {
            return Err(TraceError::Header {
                file: reader.file().to_string(),
                reason: "with --rules the routes set every cost; drop the cost column".into(),
            }
            .into());
        }
    } else if cols.cost_after.is_some() {
        return Err(TraceError::Header {
            file: reader.file().to_string(),
            reason: "the cost_after column needs --rules: the rules say which limits are post-paid and what they reserve".into(),
        }
        .into());
    }
    if cols.ip.is_none() && replays.iter().any(Replay::needs_ip) {
        return Err(TraceError::Header {
            file: reader.file().to_string(),
            reason: "the edge design counts requests per source address: the trace needs an \"ip\" column"
                .into(),
        }
        .into());
    }
    let mut rows = 0u64;
    let mut verdicts = Vec::with_capacity(replays.len());
    loop {
        verdicts.clear();
        let parsed: Result<Option<u64>, RowError> = {
            let Some(row) = reader.next_row()? else { break };
            (|| {
                let time_us = trace::parse_time_us(row.time).map_err(|e| RowError::new("time", e))?;
                let key = std::str::from_utf8(row.key).map_err(|_| RowError::new("key", "not UTF-8"))?;
                let gateway = row
                    .gateway
                    .map(|g| parse_whole(g, "a 0-based gateway index"))
                    .transpose()
                    .map_err(|e| RowError::new("gateway", e))?;
                let cost = row
                    .cost
                    .map(|c| parse_whole(c, "the tokens this request costs"))
                    .transpose()
                    .map_err(|e| RowError::new("cost", e))?;
                // Empty: the answer reported nothing.
                let cost_after = row
                    .cost_after
                    .filter(|c| !c.is_empty())
                    .map(|c| parse_whole(c, "the tokens the upstream's answer reported"))
                    .transpose()
                    .map_err(|e| RowError::new("cost_after", e))?;
                let req = Request {
                    time_us,
                    key,
                    gateway,
                    cost,
                    cost_after,
                    method: row.method,
                    path: row.path,
                    ip: row.ip,
                    fingerprint: row.fingerprint,
                };
                for replay in replays.iter_mut() {
                    verdicts.push(replay.check(&req)?);
                }
                Ok(Some(time_us))
            })()
        };
        let time_us = match parsed {
            Ok(Some(x)) => x,
            Ok(None) => break,
            Err(e) => return Err(reader.field_error(e).into()),
        };
        on_row(time_us, &verdicts, replays)?;
        rows += 1;
        if progress && rows.is_multiple_of(PROGRESS_EVERY) {
            match total_bytes {
                Some(t) if t > 0 => eprintln!(
                    "replay: {} rows ({:.0}%)",
                    report::group(rows),
                    reader.bytes_read() as f64 * 100.0 / t as f64
                ),
                _ => eprintln!("replay: {} rows", report::group(rows)),
            }
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests;
