//! The `tollgate replay` command line, and the command itself: read a trace (or generate one),
//! replay it under each `--design`, print the table or `--json`, write `--decisions` and draw
//! `--plot`; or hand the gateway's access logs to [`super::logs`].

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::PathBuf;
use std::sync::Arc;

use clap::{ArgAction, Args, ValueEnum};

use super::edge::EdgeConfig;
use super::lines::Lines;
use super::logs::{self, Inputs};
use super::plot::{Admitted, Chart, Format, Window};
use super::report::{DecisionWriter, Summary};
use super::trace::{TraceReader, parse_time_us};
use super::{Algorithm, Design, LimitSpec, Replay, ReplayError, Settings, generate, run_trace, setting};
use tollgate_limit::bucket::{Rate, US_PER_S};
use tollgate_rules::CompileOptions;

/// A trace the command can generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Generated {
    /// A retry storm on k-7 (40 workers, 400 a second for two minutes, with normal traffic
    /// before and after): 48,615 rows from 08:59:00 to 09:02:59.8. With --second-app, a second
    /// app of the same partner beside it, behind one address.
    Storm,
    /// A hot key: k-big at 100,000 a second for one minute from 09:10:00 (6,000,000 rows).
    Hot,
}

#[derive(Debug, Args)]
#[command(after_help = "\
FILE: a CSV trace, or the gateway's access logs (JSON or combined); .gz files are read as they
are. The content tells which, not the name.

Trace: CSV with a header row. Required columns: time (decimal seconds, up to 6 decimals), key.
Optional: gateway (0-based; default round-robin over rows), cost (default 1), and method, path, ip
for --rules (key is then the key id from the rules file, such as k-7, never the secret); ip for
--design edge.

Examples:
  tollgate replay --generate storm -o storm.csv
  tollgate replay storm.csv --rate 600/60s --burst 20
  tollgate replay storm.csv --rate 600/60s --burst 20 --design local --json
  tollgate replay storm.csv --rate 600/60s --algorithm fixed-window --decisions out.csv
  tollgate replay exports.csv --rules rules/demo.json
  tollgate replay --generate hot -o hot.csv
  tollgate replay hot.csv --rate 10000/1s --burst 20000 --design lease --seed 1 --excess-from 33000.25
  tollgate replay storm.csv --rate 600/60s --burst 20 --design central,local --plot storm.svg
  tollgate replay storm.csv --rate 600/60s --burst 20 --plot-tokens k-7 --plot-window 32400..+300ms --plot first-300ms.png
  tollgate replay storm.csv --algorithm queue --rate 10/1s --queue 20 --decisions waits.csv
  tollgate replay --generate storm --second-app 20/1s -o two-apps.csv
  tollgate replay two-apps.csv --design edge --edge-rule 3000/60s --json
  tollgate replay two-apps.csv --design edge,central --edge-rule 3000/60s --rate 600/60s --burst 20

Access logs: one or more files, several gateways' merged in the order of their limit checks
(check_us), replayed under --rules as one fleet with a central store; per key, how many the
replay decides as the gateway logged (agree) and how many not. --against proposed.json replays
the same lines under a second rules file: per key, the requests it would newly refuse or admit.
Lines that are not access lines are skipped and counted, and so are requests no limit checked
and those the log can't replay (limits on headers, body fields or JWT claims).

Bounds, in access logs and CSV traces alike: a line (or CSV row) over 64 KiB, or with a field
over its bound (a key id over 1 KiB, a path over 16 KiB), is skipped and counted as too long.

  tollgate replay gw-1.log gw-2.log.gz --rules running.json
  tollgate replay gw-*.log --rules running.json --against proposed.json --json
  tollgate replay gw-1.log --rules running.json --against proposed.json --max-newly-refused 0.5

With --max-newly-refused PCT the exit status is 3 when some key's newly refused requests are
more than PCT % of those the running rules admit, 1 when the replay cannot run, 0 otherwise.

The edge design replaces the gateway's limit with a WAF's rate-based rule, modelled on AWS WAF:
it counts each address's requests over the trailing W of --edge-rule N/W, checks the count every
--edge-check (on multiples of it from midnight), and blocks (or lifts a block) --edge-delay after
the first check over the limit (or, while blocking, the first not over it). --rate, --burst and
--rules apply to the other designs beside it.

Several designs (--design central,local,shares) replay the trace once each: the table prints one
block per design, --json an array of the one-design objects in --design order, and --decisions
a pair of columns per design (central_admitted,central_retry_after,local_admitted,…).

Decisions CSV: admitted,retry_after per trace row, in trace order: 1,0 when admitted; 0,N when
limited with Retry-After N seconds; 0, (empty) when no wait can help (cost above the burst). The
queue adds wait_us: microseconds from arrival to release, empty when refused. A request the edge
rule blocked has N = the seconds until the block lifts.")]
pub struct ReplayArgs {
    /// The trace CSV, or the gateway's access logs (JSON or combined, .gz too); - for
    /// standard input.
    #[arg(value_name = "FILE", required_unless_present = "generate")]
    pub trace: Vec<PathBuf>,
    /// Replay against this rules file: routes, costs, several limits per request. For access
    /// logs: the rules the gateway ran.
    #[arg(long, conflicts_with_all = ["rate", "burst"])]
    pub rules: Option<PathBuf>,
    /// Access logs: replay the same lines under this proposed rules file too, and compare.
    #[arg(long, value_name = "PROPOSED")]
    pub against: Option<PathBuf>,
    /// With --against: exit with status 3 when a key's newly refused requests are more than
    /// PCT % of those the running rules admit.
    #[arg(long, value_name = "PCT", value_parser = logs::parse_pct, requires = "against")]
    pub max_newly_refused: Option<f64>,
    /// One limit per key: N tokens per period, such as 10/1s, 600/60s or 1/5s.
    #[arg(long, value_parser = Rate::parse)]
    pub rate: Option<Rate>,
    /// The bucket's burst in tokens (token-bucket and gcra; window algorithms and the queue
    /// have none).
    #[arg(long)]
    pub burst: Option<u64>,
    /// With --algorithm queue: how many requests may wait behind the one being released.
    #[arg(long, required_if_eq("algorithm", "queue"))]
    pub queue: Option<u64>,
    /// How the fleet shares the limit; several, comma-separated, replay the trace under each.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "central")]
    pub design: Vec<Design>,
    /// How the limit counts.
    #[arg(long, value_enum, default_value_t)]
    pub algorithm: Algorithm,
    /// Gateways in the fleet, N.
    #[arg(long, default_value_t = 20)]
    pub gateways: u64,
    /// Seed for the lease design's 0–50 ms jitter.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Lease design: the store round trip of a lease call (us, ms or s).
    #[arg(long, default_value = "1ms", value_parser = parse_micros)]
    pub lease_rtt: u64,
    /// Lease design: tokens per block, or "auto" for max(10, ceil(0.25 s x r / N)).
    #[arg(long, value_parser = parse_block)]
    pub lease_block: Option<Block>,
    /// worst_excess counts only intervals that start at or after this time (trace seconds).
    #[arg(long, value_parser = parse_time)]
    pub excess_from: Option<u64>,
    /// Print the summary as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Write one `admitted,retry_after` row per trace row to this CSV file.
    #[arg(long)]
    pub decisions: Option<PathBuf>,
    /// Draw admitted per second for each design to this file: .svg or .png.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Also draw this key's bucket tokens over time, in a second panel of the --plot file.
    #[arg(long, value_name = "KEY", requires = "plot")]
    pub plot_tokens: Option<String>,
    /// With local or shares, which gateway's bucket --plot-tokens draws (0-based).
    #[arg(long, default_value_t = 0, requires = "plot_tokens")]
    pub plot_gateway: u64,
    /// The span the charts show, FROM..TO in trace seconds; TO may be +DURATION after FROM
    /// (32400..+300ms). Either end left out is the trace's own.
    #[arg(long, value_name = "FROM..TO", value_parser = Window::parse, requires = "plot")]
    pub plot_window: Option<Window>,
    /// Write a generated trace instead of replaying one.
    #[arg(long, value_enum, conflicts_with_all = [
        "trace", "rules", "rate", "burst", "queue", "json", "decisions", "plot",
        "edge_rule", "edge_check", "edge_delay", "edge_count_blocked", "against",
        "max_newly_refused",
    ])]
    pub generate: Option<Generated>,
    /// Where --generate writes (default: standard output).
    #[arg(short = 'o', long, requires = "generate")]
    pub output: Option<PathBuf>,
    /// With --generate storm: a second app of the partner, k-8, at this rate (evenly) from
    /// 08:59:00 until 09:05:00, and an ip column: both apps behind the one address 198.51.100.7.
    #[arg(long, value_name = "N/P", value_parser = Rate::parse, requires = "generate")]
    pub second_app: Option<Rate>,
    /// The edge design's rule: at most N requests from one address in any trailing W, such as
    /// 3000/60s.
    #[arg(long, value_name = "N/W", value_parser = Rate::parse)]
    pub edge_rule: Option<Rate>,
    /// The edge design: how often the rule checks each address's count [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = parse_micros)]
    pub edge_check: Option<u64>,
    /// The edge design: how long after a check its block, or lift, takes effect [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = parse_micros)]
    pub edge_delay: Option<u64>,
    /// The edge design: whether blocked requests count toward the rate [default: true].
    #[arg(long, value_name = "true|false", action = ArgAction::Set)]
    pub edge_count_blocked: Option<bool>,
}

/// A lease block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    Auto,
    Tokens(u64),
}

fn parse_block(text: &str) -> Result<Block, String> {
    if text == "auto" {
        return Ok(Block::Auto);
    }
    match text.parse::<u64>() {
        Ok(0) | Err(_) => Err(format!(
            "{text:?}: a block is \"auto\" or a whole number of tokens, 1 or more"
        )),
        Ok(n) => Ok(Block::Tokens(n)),
    }
}

fn parse_time(text: &str) -> Result<u64, String> {
    parse_time_us(text.as_bytes())
}

/// `250us`, `1ms`, `2s`, or `0`.
pub(crate) fn parse_micros(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if t == "0" {
        return Ok(0);
    }
    let split = t
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} needs a unit: us, ms or s"))?;
    let (n, unit) = t.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{text:?} must start with a whole number"))?;
    let mult = match unit {
        "us" | "µs" => 1,
        "ms" => 1_000,
        "s" => 1_000_000,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (use us, ms or s)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{text:?} is too long"))
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ReplayError {
    let what = what.into();
    move |e| ReplayError::Io {
        what,
        reason: e.to_string(),
    }
}

/// The designs to replay, in the order given; each at most once.
fn designs(a: &ReplayArgs) -> Result<Vec<Design>, ReplayError> {
    let mut out: Vec<Design> = Vec::with_capacity(a.design.len());
    for &d in &a.design {
        if out.contains(&d) {
            return Err(setting("--design", format!("{} is listed twice", d.name())));
        }
        out.push(d);
    }
    if out.is_empty() {
        out.push(Design::default());
    }
    if matches!(a.lease_block, Some(Block::Tokens(_))) && !out.contains(&Design::Lease) {
        return Err(setting(
            "--lease-block",
            "only means something with --design lease",
        ));
    }
    Ok(out)
}

/// The settings these arguments describe, one per design in `--design` order (the rules file
/// is loaded and compiled here, once).
pub fn settings(a: &ReplayArgs) -> Result<Vec<Settings>, ReplayError> {
    let designs = designs(a)?;
    let edge = designs.contains(&Design::Edge);
    let others = designs.iter().any(|&d| d != Design::Edge);
    let edge_flags = [
        ("--edge-rule", a.edge_rule.is_some()),
        ("--edge-check", a.edge_check.is_some()),
        ("--edge-delay", a.edge_delay.is_some()),
        ("--edge-count-blocked", a.edge_count_blocked.is_some()),
    ];
    if let Some((flag, _)) = edge_flags.iter().find(|f| f.1 && !edge) {
        return Err(setting(flag, "only means something with --design edge"));
    }
    if !others {
        let gateway_flags = [
            ("--rate", a.rate.is_some()),
            ("--burst", a.burst.is_some()),
            ("--rules", a.rules.is_some()),
            ("--queue", a.queue.is_some()),
            ("--algorithm", a.algorithm != Algorithm::default()),
        ];
        if let Some((flag, _)) = gateway_flags.iter().find(|f| f.1) {
            return Err(setting(
                flag,
                "the edge design replays its own rule, --edge-rule; add a design for the gateway's limit beside it, such as --design edge,central",
            ));
        }
    }
    let limit = match (&a.rules, a.rate) {
        _ if !others => None,
        (Some(path), _) => {
            let snap = tollgate_rules::load(path, CompileOptions::default())?;
            Some(LimitSpec::Rules(Arc::new(snap)))
        }
        (None, Some(rate)) => Some(LimitSpec::Single { rate, burst: a.burst }),
        (None, None) => {
            return Err(setting(
                "--rate",
                "give --rate N/P (with --burst B), or --rules FILE",
            ));
        }
    };
    let edge_cfg = match a.edge_rule {
        Some(rule) => Some(EdgeConfig {
            rule,
            check_us: a.edge_check.unwrap_or(10 * US_PER_S),
            delay_us: a.edge_delay.unwrap_or(30 * US_PER_S),
            count_blocked: a.edge_count_blocked.unwrap_or(true),
        }),
        None if edge => {
            return Err(setting(
                "--edge-rule",
                "required with --design edge: the rule's N requests per trailing window W from one address, such as 3000/60s",
            ));
        }
        None => None,
    };
    Ok(designs
        .into_iter()
        .filter_map(|design| {
            let limit = match design {
                Design::Edge => LimitSpec::Edge(edge_cfg?),
                _ => limit.clone()?,
            };
            Some(Settings {
                limit,
                design,
                algorithm: a.algorithm,
                gateways: a.gateways,
                seed: a.seed,
                lease_rtt_us: a.lease_rtt,
                lease_block: match a.lease_block {
                    Some(Block::Tokens(n)) if design == Design::Lease => Some(n),
                    _ => None,
                },
                excess_from_us: a.excess_from,
                queue: a.queue.filter(|_| design != Design::Edge),
            })
        })
        .collect())
}

/// Runs `tollgate replay`.
pub fn main(a: &ReplayArgs) -> Result<(), ReplayError> {
    if let Some(which) = a.generate {
        if a.gateways == 0 {
            return Err(setting("--gateways", "must be at least 1"));
        }
        if a.second_app.is_some() && which != Generated::Storm {
            return Err(setting("--second-app", "goes with --generate storm"));
        }
        let target = a
            .output
            .as_ref()
            .map_or("standard output".to_string(), |p| p.display().to_string());
        let mut out: Box<dyn Write> = match &a.output {
            Some(p) => Box::new(BufWriter::with_capacity(
                1 << 20,
                File::create(p).map_err(io_err(format!("cannot create {}", p.display())))?,
            )),
            None => Box::new(BufWriter::with_capacity(1 << 20, io::stdout().lock())),
        };
        let written = match (which, a.second_app) {
            (Generated::Storm, None) => {
                generate::write_csv(generate::storm(a.gateways).into_iter(), None, &mut out)
            }
            (Generated::Storm, Some(rate)) => generate::write_csv(
                generate::with_second_app(generate::storm(a.gateways), rate, a.gateways),
                Some(generate::PARTNER_IP),
                &mut out,
            ),
            (Generated::Hot, _) => generate::write_csv(generate::hot(a.gateways), None, &mut out),
        };
        written.map_err(io_err(format!("cannot write {target}")))?;
        return Ok(());
    }
    if a.trace.is_empty() {
        return Err(setting(
            "FILE",
            "give a trace file, access logs, - for standard input, or --generate",
        ));
    }
    let inputs = a
        .trace
        .iter()
        .map(|p| logs::open(p))
        .collect::<Result<Vec<_>, _>>()?;
    match logs::classify(inputs)? {
        Inputs::Trace(input) => {
            logs::refuse_log_flags(a)?;
            let (name, size) = (input.name.clone(), input.size);
            replay_trace(a, input.into_lines(), &name, size)
        }
        Inputs::Logs(inputs) => logs::main(a, inputs),
    }
}

/// Replays one CSV trace under each design.
fn replay_trace(
    a: &ReplayArgs,
    input: Lines<Box<dyn io::BufRead>>,
    name: &str,
    size: Option<u64>,
) -> Result<(), ReplayError> {
    let settings = settings(a)?;
    let designs: Vec<Design> = settings.iter().map(|s| s.design).collect();
    // Refuse a bad --plot before a long replay, not after it.
    if let Some(p) = &a.plot {
        Format::of(p)?;
    }
    let window = a.plot_window.unwrap_or_default();
    let mut replays = settings
        .into_iter()
        .map(Replay::new)
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(key) = &a.plot_tokens {
        for r in &mut replays {
            r.watch_tokens(key, a.plot_gateway, window)?;
        }
    }
    let mut reader = TraceReader::new(input, name)?;
    let mut decisions = match &a.decisions {
        Some(p) => {
            let f = File::create(p).map_err(io_err(format!("cannot create {}", p.display())))?;
            let columns: Vec<(&str, bool)> = designs
                .iter()
                .zip(&replays)
                .map(|(d, r)| (d.name(), r.waits()))
                .collect();
            Some(
                DecisionWriter::new(BufWriter::with_capacity(1 << 20, f), &columns)
                    .map_err(io_err(format!("cannot write {}", p.display())))?,
            )
        }
        None => None,
    };
    let dname = a
        .decisions
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let mut admitted = a.plot.as_ref().map(|_| Admitted::new(window, designs.len()));
    run_trace(&mut replays, &mut reader, true, size, &mut |t, v, replays| {
        if let Some(d) = decisions.as_mut() {
            d.write(t, v, &mut |i, b| replays[i].block_end(b, Some(t)))
                .map_err(io_err(format!("cannot write {dname}")))?;
        }
        if let Some(p) = admitted.as_mut() {
            p.row(t, v);
        }
        Ok(())
    })?;
    if let Some(d) = decisions {
        d.finish(&mut |i, b| replays[i].block_end(b, None))
            .map_err(io_err(format!("cannot write {dname}")))?;
    }
    let mut summaries: Vec<Summary> = replays.iter().map(Replay::summary).collect();
    for s in &mut summaries {
        s.too_long_rows = reader.too_long();
    }
    let mut out = io::stdout().lock();
    let written = match (a.json, summaries.as_slice()) {
        (true, [one]) => writeln!(out, "{}", one.to_json()),
        (true, many) => writeln!(out, "{}", Summary::many_to_json(many)),
        (false, many) => many.iter().enumerate().try_for_each(|(i, s)| {
            if i > 0 {
                writeln!(out)?;
            }
            s.write_table(&mut out)
        }),
    };
    written.map_err(io_err("cannot write to standard output"))?;
    // After the summary: a chart that cannot be written must not cost the figures.
    if let (Some(path), Some(admitted)) = (&a.plot, admitted) {
        plot(a, path, &designs, &replays, &summaries[0], admitted)?;
    }
    Ok(())
}

/// Draws `--plot` from what the replays recorded.
fn plot(
    a: &ReplayArgs,
    path: &std::path::Path,
    designs: &[Design],
    replays: &[Replay],
    summary: &Summary,
    admitted: Admitted,
) -> Result<(), ReplayError> {
    let tokens = match &a.plot_tokens {
        None => None,
        Some(key) => {
            let mut traces = Vec::with_capacity(replays.len());
            for (r, d) in replays.iter().zip(designs) {
                let Some(t) = r.token_trace() else {
                    return Err(setting(
                        "--plot-tokens",
                        format!("{key:?} is not a key of this trace"),
                    ));
                };
                let label = match d {
                    Design::Local | Design::Shares => format!("{} (gateway {})", d.name(), a.plot_gateway),
                    _ => d.name().to_string(),
                };
                traces.push((label, t.clone()));
            }
            Some((key.clone(), traces))
        }
    };
    let chart = Chart {
        subject: format!(
            "{}, {}, {} gateways",
            summary.limit, summary.algorithm, summary.gateways
        ),
        designs,
        admitted,
        tokens,
    };
    chart.write(path)
}
