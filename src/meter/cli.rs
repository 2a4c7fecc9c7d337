//! The `tollgate meter` command line: the consumer (`tollgate meter --store … --rules …`) and
//! its two questions, `usage` (one key, one day or month, as JSON) and `export` (a month of
//! every key, as CSV for invoices), on Redis or on the embedded store's metering file.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tollgate_access::{Access, TlsFiles};

use jiff::tz::TimeZone;
use tollgate_limit::clock::parse_duration;
use tollgate_rules::quota::{self, Per};

use crate::consumer::{self, RulesFile, RunOptions};
use crate::ledger::{Ledger, Place};
use crate::ledger_types::{PeriodLabel, Role};
use crate::metrics::{self, MeterMetrics};

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct MeterArgs {
    #[command(subcommand)]
    pub command: Option<MeterCommand>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, clap::Subcommand)]
pub enum MeterCommand {
    /// Print one key's admitted requests in one day or month of its quota's time zone, as JSON.
    Usage(UsageArgs),
    /// Write every key's usage in one month to a CSV file (for invoices).
    Export(ExportArgs),
}

/// Where the records and the ledger are, and the rules that give each key its tenant and its
/// quota's time zone.
#[derive(Debug, Clone, clap::Args)]
pub struct Source {
    /// The Redis the gateways write `tollgate:usage` to: redis://HOST:PORT, or
    /// redis-cluster://H1:P1,H2:P2; over TLS rediss://… and rediss-cluster://….
    #[arg(
        long,
        value_name = "URL",
        conflicts_with = "meter_file",
        required_unless_present = "meter_file"
    )]
    pub store: Option<String>,
    /// PEM CA certificates a TLS store's certificate must chain to; the built-in roots without.
    #[arg(long, env = "TOLLGATE_STORE_CA", value_name = "FILE")]
    pub store_ca: Option<PathBuf>,
    /// PEM client certificate chain, for a TLS store that asks for one.
    #[arg(
        long,
        env = "TOLLGATE_STORE_CERT",
        value_name = "FILE",
        requires = "store_key"
    )]
    pub store_cert: Option<PathBuf>,
    /// PEM private key for --store-cert.
    #[arg(
        long,
        env = "TOLLGATE_STORE_KEY",
        value_name = "FILE",
        requires = "store_cert"
    )]
    pub store_key: Option<PathBuf>,
    /// The name a TLS store's certificate must carry, where the URL's host is not that name.
    #[arg(long, env = "TOLLGATE_STORE_SERVER_NAME", value_name = "NAME")]
    pub store_server_name: Option<String>,
    /// The store's ACL user (or put it in the URL).
    #[arg(long, env = "TOLLGATE_STORE_USERNAME", value_name = "USER")]
    pub store_username: Option<String>,
    /// A file whose first line is the store's password: out of `ps` and the environment.
    #[arg(long, env = "TOLLGATE_STORE_PASSWORD_FILE", value_name = "FILE")]
    pub store_password_file: Option<PathBuf>,
    /// The embedded store's metering file (SQLite), instead of --store.
    #[arg(long, value_name = "PATH")]
    pub meter_file: Option<PathBuf>,
    /// The rules file: each key's tenant and quota.
    // An Option that clap requires: a plain PathBuf would be wanted before a subcommand too.
    #[arg(long, value_name = "PATH", required = true)]
    pub rules: Option<PathBuf>,
}

impl Source {
    fn place(&self) -> Result<Place, String> {
        match (&self.store, &self.meter_file) {
            (Some(url), None) => Ok(Place::Redis {
                url: url.clone(),
                access: Access::from_flags(
                    TlsFiles {
                        ca: self.store_ca.clone(),
                        client: self.store_cert.clone().zip(self.store_key.clone()),
                        server_name: self.store_server_name.clone(),
                    },
                    self.store_username.clone(),
                    self.store_password_file.clone(),
                )?,
            }),
            (None, Some(path)) => Ok(Place::File(path.clone())),
            _ => Err("give either --store redis://HOST:PORT or --meter-file PATH".into()),
        }
    }

    fn rules(&self) -> Result<&Path, String> {
        self.rules
            .as_deref()
            .ok_or_else(|| "--rules PATH is required".to_string())
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub source: Source,
    /// Add up every record there is now, report silent identities, set the flags, and exit.
    #[arg(long)]
    pub once: bool,
    /// An identity whose newest record is older than this and that sent no end record ended
    /// uncleanly (`250ms`, `15s`, `2m`).
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub silence: Duration,
    /// Serve Prometheus metrics at http://ADDR/metrics (`127.0.0.1:0` picks a port, printed).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// Records taken and added up per pass.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub batch: u64,
    /// Take over records another consumer has held unacknowledged this long (it stopped or
    /// failed); Redis only.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub claim_idle: Duration,
    /// How often to look for new records once caught up.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub poll: Duration,
}

#[derive(Debug, Clone, clap::Args)]
pub struct UsageArgs {
    #[command(flatten)]
    pub source: Source,
    /// The key's id, as in the rules (`k-7`).
    #[arg(long)]
    pub key: String,
    /// A day of the key's time zone (default: today there).
    #[arg(long, value_name = "YYYY-MM-DD", conflicts_with = "month")]
    pub day: Option<String>,
    /// A month of the key's time zone.
    #[arg(long, value_name = "YYYY-MM")]
    pub month: Option<String>,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ExportArgs {
    #[command(flatten)]
    pub source: Source,
    /// The month, in each key's own time zone.
    #[arg(long, value_name = "YYYY-MM")]
    pub month: String,
    /// The CSV file to write.
    #[arg(short = 'o', long = "output", value_name = "FILE.csv")]
    pub output: PathBuf,
}

/// Runs `tollgate meter …` on a runtime of its own; the error names the flag, file or field.
pub fn main(args: &MeterArgs) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    rt.block_on(async {
        match &args.command {
            None => run(&args.run).await,
            Some(MeterCommand::Usage(a)) => usage(a).await,
            Some(MeterCommand::Export(a)) => export(a).await,
        }
    })
}

async fn open(source: &Source, role: Role) -> Result<Ledger, String> {
    let place = source.place()?;
    if let (Place::File(path), Role::Reader) = (&place, role) {
        // A question about a file that isn't there has no answer; making it would say 0.
        if !path.exists() {
            return Err(format!("--meter-file {}: no such file", path.display()));
        }
    }
    Ledger::open(&place, role).await
}

async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        },
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

async fn run(a: &RunArgs) -> Result<(), String> {
    let rules = RulesFile::load(a.source.rules()?.to_path_buf())?;
    let role = Role::Consumer {
        claim_idle_ms: a.claim_idle.as_millis() as u64,
    };
    let mut ledger = open(&a.source, role).await?;
    let metrics = MeterMetrics::new();
    if let Some(addr) = a.metrics_listen {
        let bound = metrics::serve(addr, metrics.clone()).await?;
        println!("meter metrics on http://{bound}/metrics");
    }
    let opts = RunOptions {
        once: a.once,
        silence: a.silence,
        batch: a.batch as usize,
        poll: a.poll,
    };
    let result = consumer::run(&mut ledger, rules, opts, &metrics, stop_signal()).await;
    ledger.close().await;
    result
}

fn key_zone(snap: &tollgate_rules::Snapshot, rules: &Path, key: &str) -> Result<TimeZone, String> {
    let i = snap.key_by_id(key).ok_or_else(|| {
        format!(
            "--key {key:?}: no key with this id in {} (its keys: {})",
            rules.display(),
            snap.keys.iter().map(|k| &*k.id).collect::<Vec<_>>().join(", ")
        )
    })?;
    Ok(snap.keys[i]
        .quota
        .as_ref()
        .map_or(TimeZone::UTC, |q| q.zone.clone()))
}

async fn usage(a: &UsageArgs) -> Result<(), String> {
    let rules = RulesFile::load(a.source.rules()?.to_path_buf())?;
    let zone = key_zone(&rules.snap, &rules.path, &a.key)?;
    let ledger = open(&a.source, Role::Reader).await?;
    let period = match (&a.day, &a.month) {
        (Some(day), _) => PeriodLabel::day(day, "--day")?,
        (None, Some(month)) => PeriodLabel::month(month, "--month")?,
        (None, None) => PeriodLabel {
            per: Per::Day,
            label: quota::period(Per::Day, &zone, ledger.now_ms().await?).label,
        },
    };
    let u = ledger.usage(&period, &a.key).await?;
    ledger.close().await;
    /// In the order the command promises (a `json!` map would sort its keys).
    #[derive(serde::Serialize)]
    struct Answer<'a> {
        key: &'a str,
        period: &'a str,
        admitted: u64,
        unclean_ends: u64,
    }
    let out = serde_json::to_string(&Answer {
        key: &a.key,
        period: &period.label,
        admitted: u.admitted,
        unclean_ends: u.unclean_ends,
    })
    .expect("an answer serializes");
    println!("{out}");
    Ok(())
}

/// A CSV field, quoted when it holds a separator, a quote or a line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

async fn export(a: &ExportArgs) -> Result<(), String> {
    let month = PeriodLabel::month(&a.month, "--month")?;
    let rules = RulesFile::load(a.source.rules()?.to_path_buf())?;
    let ledger = open(&a.source, Role::Reader).await?;
    let rows = ledger.period_rows(&month).await?;
    ledger.close().await;
    let mut text = String::from("key,tenant,period,admitted,identities,unclean_ends\n");
    for (key, u) in &rows {
        let tenant = match rules.snap.key_by_id(key) {
            Some(i) => rules.snap.keys[i].tenant.to_string(),
            None => {
                tracing::warn!(
                    key = %key,
                    "key {key} has usage in {} but is not in {}: its tenant column is left empty",
                    month.label,
                    rules.path.display()
                );
                String::new()
            }
        };
        text.push_str(&format!(
            "{},{},{},{},{},{}\n",
            csv_field(key),
            csv_field(&tenant),
            month.label,
            u.admitted,
            u.identities,
            u.unclean_ends
        ));
    }
    // Written beside and renamed over, so a reader never sees half a file.
    let out = &a.output;
    let fail = |e: std::io::Error| format!("-o {}: cannot write: {e}", out.display());
    let mut tmp_name = out.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    let mut f = std::fs::File::create(&tmp).map_err(fail)?;
    f.write_all(text.as_bytes()).map_err(fail)?;
    f.sync_all().map_err(fail)?;
    std::fs::rename(&tmp, out).map_err(fail)?;
    println!(
        "wrote {} rows for {} to {}",
        rows.len(),
        month.label,
        out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// As `src/main.rs` holds it: `tollgate meter …`.
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        top: Top,
    }

    #[derive(Debug, clap::Subcommand)]
    enum Top {
        Meter(MeterArgs),
    }

    fn parse(args: &[&str]) -> Result<MeterArgs, clap::Error> {
        let all = ["tollgate", "meter"].iter().chain(args);
        Cli::try_parse_from(all).map(|c| match c.top {
            Top::Meter(m) => m,
        })
    }

    #[test]
    fn durations_name_their_unit() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("15s").unwrap(), Duration::from_secs(15));
        assert!(parse_duration("15").unwrap_err().contains("unit"));
        assert!(parse_duration("15d").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn the_consumer_and_the_questions_parse() {
        let c = parse(&["--store", "redis://h:1", "--rules", "r.json", "--once"]).unwrap();
        assert!(c.command.is_none() && c.run.once);
        let c = parse(&[
            "usage",
            "--meter-file",
            "u.db",
            "--rules",
            "r.json",
            "--key",
            "k-7",
            "--month",
            "2026-12",
        ])
        .unwrap();
        assert!(
            matches!(c.command, Some(MeterCommand::Usage(ref u)) if u.month.as_deref() == Some("2026-12"))
        );
        // One place, not both, not none.
        assert!(parse(&["--store", "redis://h:1", "--meter-file", "u.db", "--rules", "r"]).is_err());
        assert!(parse(&["--rules", "r.json"]).is_err());
        assert!(parse(&["usage", "--rules", "r", "--key", "k"]).is_err());
        assert!(
            parse(&[
                "usage",
                "--store",
                "redis://h:1",
                "--rules",
                "r",
                "--key",
                "k",
                "--day",
                "2026-12-01",
                "--month",
                "2026-12"
            ])
            .is_err()
        );
    }

    #[test]
    fn csv_fields_are_quoted_when_needed() {
        assert_eq!(csv_field("k-7"), "k-7");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }
}
