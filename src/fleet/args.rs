//! The `tollgate fleet` command line, checked into a `Plan` before any process starts.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use tollgate_gateway::config::parse_duration;

/// How the gateways of one run share k-7's limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Every gateway on the one Redis (one limit for the fleet).
    Central,
    /// Every gateway on its own embedded store with the full limit (each gateway admits the whole limit).
    Local,
    /// Every gateway on its own embedded store with rate r/N and burst max(1, b/N).
    Shares,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Central => "central",
            Mode::Local => "local",
            Mode::Shares => "shares",
        }
    }
}

/// A failure policy for the outage run, set on every capacity limit of the rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    Open,
    Closed,
    Local,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Open => "open",
            Policy::Closed => "closed",
            Policy::Local => "local",
        }
    }
}

#[derive(Debug, Args)]
#[command(after_help = "\
Starts one redis-server (unless --redis-url), the demo upstream and N `tollgate serve` processes
on free loopback ports, drives a retry storm (40 clients resending at once) on k7-demo-key round-robin over the gateways with
the other partners' normal traffic beside it, prints the report, and stops everything it started.

Examples:
  tollgate fleet                                  # central, local, shares; 120 s each
  tollgate fleet --quick --json                   # 20 s each, JSON (what the tests run)
  tollgate fleet --modes central --flood --duration 20s   # the harness's own ceiling
  tollgate fleet --outage 12s                     # the store stopped mid-storm: open/closed/local

Each storm worker sends its next request when the answer comes, padded to --pad (100 ms), so 40
workers offer 400/s. The report says so when the machine could not reach that rate.")]
pub struct FleetArgs {
    /// Gateways to start (each `tollgate serve --threads 1 --fleet-size N`).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=200))]
    pub gateways: u32,
    /// Storm length per mode.
    #[arg(long, default_value = "120s", value_parser = parse_duration, conflicts_with = "quick")]
    pub duration: Duration,
    /// 20 s per mode instead of --duration (the tests' quick run).
    #[arg(long)]
    pub quick: bool,
    /// Closed-loop storm workers on the storm key.
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub workers: u32,
    /// Each storm answer counts as taking at least this long (the worker waits out the rest).
    #[arg(long, default_value = "100ms", value_parser = parse_duration)]
    pub pad: Duration,
    /// No padding: every storm worker sends again as soon as its answer comes.
    #[arg(long)]
    pub flood: bool,
    /// The other partners' normal traffic, requests a second in total over --partner-keys.
    #[arg(long, default_value_t = 100)]
    pub others_rate: u32,
    /// Modes to compare, in order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "central,local,shares"
    )]
    pub modes: Vec<Mode>,
    /// A store outage: stop the store (SIGSTOP) this long at the storm's midpoint, once per --policies.
    #[arg(long, value_parser = parse_duration)]
    pub outage: Option<Duration>,
    /// Failure policies to run with --outage, set on every capacity limit.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "open,closed,local",
        requires = "outage"
    )]
    pub policies: Vec<Policy>,
    /// Use this running Redis or Valkey instead of starting redis-server (not with --outage).
    #[arg(long, conflicts_with = "outage")]
    pub redis_url: Option<String>,
    /// Rules file (default: the built-in rules/fleet.json); its upstreams are pointed at the
    /// demo upstream.
    #[arg(long)]
    pub rules: Option<PathBuf>,
    /// The storm's API key (secret).
    #[arg(long, default_value = "k7-demo-key")]
    pub storm_key: String,
    /// The other partners' API keys (secrets), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "k11-demo-key,k12-demo-key,k13-demo-key,k14-demo-key,k15-demo-key"
    )]
    pub partner_keys: Vec<String>,
    /// Passed to every gateway: how long a check waits for Redis before the failure policy
    /// decides.
    #[arg(long, default_value = "3ms", value_parser = parse_duration)]
    pub store_timeout: Duration,
    /// Worker threads of each gateway.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub gateway_threads: u16,
    /// TOLLGATE_LOG for the gateways (info logs one access line per request).
    #[arg(long, default_value = "warn")]
    pub gateway_log: String,
    /// Keep every process's log and the rules of each run in this directory (default: a
    /// temporary directory, removed at the end).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Write each run's storm requests to DIR/<run>.csv as a `tollgate replay` trace (time,
    /// key, gateway), to replay the same arrivals through each design offline.
    #[arg(long)]
    pub trace_dir: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// One run: a mode, and for the outage run the failure policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RunSpec {
    pub mode: Mode,
    pub policy: Option<Policy>,
}

impl RunSpec {
    pub fn label(&self) -> String {
        match self.policy {
            Some(p) => format!("{}/{}", self.mode.name(), p.name()),
            None => self.mode.name().to_string(),
        }
    }
}

/// The checked settings of a fleet run.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub gateways: u32,
    pub duration: Duration,
    pub workers: u32,
    /// `None` floods.
    pub pad: Option<Duration>,
    pub others_rate: u32,
    pub runs: Vec<RunSpec>,
    pub outage: Option<Duration>,
    pub redis_url: Option<String>,
    pub rules: Option<PathBuf>,
    pub storm_key: String,
    pub partner_keys: Vec<String>,
    pub store_timeout: Duration,
    pub gateway_threads: u16,
    pub gateway_log: String,
    pub log_dir: Option<PathBuf>,
    pub trace_dir: Option<PathBuf>,
    pub json: bool,
}

impl Plan {
    pub(crate) fn from_args(a: &FleetArgs) -> Result<Plan, String> {
        let duration = if a.quick {
            Duration::from_secs(20)
        } else {
            a.duration
        };
        if duration < Duration::from_secs(2) {
            return Err(format!(
                "--duration {duration:?}: a storm needs at least 2 s to say anything about a rate"
            ));
        }
        if !a.flood && a.pad.is_zero() {
            return Err("--pad 0ms: use --flood to drop the padding".into());
        }
        let mut modes = a.modes.clone();
        modes.dedup();
        let runs: Vec<RunSpec> = match a.outage {
            Some(out) => {
                if modes != [Mode::Central] && modes != [Mode::Central, Mode::Local, Mode::Shares] {
                    return Err(
                        "--outage runs the central mode once per --policies; leave --modes out or set it to central"
                            .into(),
                    );
                }
                if out * 2 > duration {
                    return Err(format!(
                        "--outage {out:?} starts at the storm's midpoint and must end before the storm does: \
                         use a --duration of at least twice the outage"
                    ));
                }
                if out.is_zero() {
                    return Err("--outage 0ms: an outage must last".into());
                }
                let mut p = a.policies.clone();
                p.dedup();
                p.into_iter()
                    .map(|policy| RunSpec {
                        mode: Mode::Central,
                        policy: Some(policy),
                    })
                    .collect()
            }
            None => modes
                .into_iter()
                .map(|mode| RunSpec { mode, policy: None })
                .collect(),
        };
        if runs.is_empty() {
            return Err("--modes: nothing to run".into());
        }
        if a.storm_key.trim().is_empty() {
            return Err("--storm-key: empty".into());
        }
        let partner_keys: Vec<String> = a
            .partner_keys
            .iter()
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .collect();
        if a.others_rate > 0 && partner_keys.is_empty() {
            return Err("--others-rate above 0 needs at least one --partner-keys".into());
        }
        if partner_keys.contains(&a.storm_key) {
            return Err(format!(
                "--partner-keys holds the storm key {:?}: the other partners must use other keys",
                a.storm_key
            ));
        }
        if let Some(url) = &a.redis_url
            && !(url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("valkey://"))
        {
            return Err(format!("--redis-url {url:?}: expected redis://HOST:PORT"));
        }
        Ok(Plan {
            gateways: a.gateways,
            duration,
            workers: a.workers,
            pad: (!a.flood).then_some(a.pad),
            others_rate: a.others_rate,
            runs,
            outage: a.outage,
            redis_url: a.redis_url.clone(),
            rules: a.rules.clone(),
            storm_key: a.storm_key.clone(),
            partner_keys,
            store_timeout: a.store_timeout,
            gateway_threads: a.gateway_threads,
            gateway_log: a.gateway_log.clone(),
            log_dir: a.log_dir.clone(),
            trace_dir: a.trace_dir.clone(),
            json: a.json,
        })
    }

    /// The storm rate the workers offer when every answer is faster than the padding.
    pub(crate) fn target_rate(&self) -> Option<f64> {
        self.pad.map(|p| f64::from(self.workers) / p.as_secs_f64())
    }

    pub(crate) fn needs_store(&self) -> bool {
        self.runs.iter().any(|r| r.mode == Mode::Central)
    }
}
