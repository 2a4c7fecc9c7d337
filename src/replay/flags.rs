//! The `tollgate replay` command line: its flags, their help text and the parsers of their
//! values. What a replay does with them is [`super::args`]'s.

use std::path::PathBuf;

use clap::{ArgAction, Args, ValueEnum};

use super::plot::Window;
use super::trace::{parse_micros, parse_time_us};
use super::{Algorithm, Design};
use tollgate_limit::bucket::Rate;

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
    #[arg(long, value_name = "PCT", value_parser = parse_pct, requires = "against")]
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

/// `--max-newly-refused`: a percentage, 0 or more.
fn parse_pct(text: &str) -> Result<f64, String> {
    let t = text.trim().trim_end_matches('%');
    match t.parse::<f64>() {
        Ok(p) if p.is_finite() && p >= 0.0 => Ok(p),
        _ => Err(format!(
            "{text:?}: a percentage of each key's admitted requests, 0 or more, such as 0.5"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages_are_zero_or_more() {
        assert_eq!(parse_pct("0"), Ok(0.0));
        assert_eq!(parse_pct("2.5%"), Ok(2.5));
        assert!(parse_pct("-1").is_err());
        assert!(parse_pct("lots").is_err());
        assert!(parse_pct("NaN").is_err());
    }
}
