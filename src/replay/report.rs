//! What a replay reports: per-key counts, the busiest 1 s and 60 s, the worst excess over the
//! rate, the queue's longest wait, the edge rule's blocks, and the outputs built from them (the
//! human table, `--json`, `--decisions` CSV).
//!
//! Busiest windows are sliding and half-open, `[s, s + w)`, over every start `s`; the worst
//! excess is the supremum of `admitted − r·t` over every interval, computed exactly in units
//! of `1 / P` token and in one pass.

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, Write};

use serde::Serialize;

use super::algorithms::Verdict;
use super::edge::{Block, EdgeRule, span};
use super::lines::{MAX_KEY_ID, MAX_LINE};

use tollgate_limit::bucket::{Rate, US_PER_S, retry_after_secs};

/// The most requests admitted in any window `[s, s + w)`, kept online with the admission
/// times of the last `w`.
#[derive(Clone, Debug)]
pub struct BusiestWindow {
    width: u64,
    times: VecDeque<u64>,
    max: u64,
}

impl BusiestWindow {
    pub fn new(width: u64) -> BusiestWindow {
        BusiestWindow {
            width,
            times: VecDeque::new(),
            max: 0,
        }
    }

    /// Every set of admissions in `(t − w, t]` fits one half-open window of width `w`, and
    /// every window's admissions are such a set for its last admission `t`.
    #[inline]
    pub fn admit(&mut self, t: u64) {
        while self.times.front().is_some_and(|&f| f + self.width <= t) {
            self.times.pop_front();
        }
        self.times.push_back(t);
        self.max = self.max.max(self.times.len() as u64);
    }

    pub fn max(&self) -> u64 {
        self.max
    }
}

/// The supremum over intervals `[s, e)` of tokens admitted minus `r·(e − s)`, for intervals
/// starting at or after `from`. The supremum is approached by intervals from one admission
/// `t_i` to just past another `t_j`: `(C_j − C_{i−1}) − r·(t_j − t_i)`. Scaled by the rate's
/// period `P` (µs), with `r = N / P`, every term is an integer.
#[derive(Clone, Debug)]
pub(crate) struct Excess {
    tokens: i128,
    period: i128,
    from: u64,
    /// Tokens admitted so far.
    cum: i128,
    /// max over admissions i (at or after `from`) of `N·t_i − P·C_{i−1}`.
    best_start: Option<i128>,
    best: Option<i128>,
}

impl Excess {
    pub fn new(rate: Rate, from: u64) -> Excess {
        Excess {
            tokens: rate.tokens as i128,
            period: rate.period_us as i128,
            from,
            cum: 0,
            best_start: None,
            best: None,
        }
    }

    #[inline]
    pub fn admit(&mut self, t: u64, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let nt = self.tokens * t as i128;
        if t >= self.from {
            let start = nt - self.period * self.cum;
            self.best_start = Some(self.best_start.map_or(start, |b| b.max(start)));
        }
        self.cum += tokens as i128;
        if let Some(s) = self.best_start {
            let e = self.period * self.cum - nt + s;
            self.best = Some(self.best.map_or(e, |b| b.max(e)));
        }
    }

    /// In tokens; `None` when no interval qualified.
    pub fn value(&self) -> Option<f64> {
        self.best.map(|b| b as f64 / self.period as f64)
    }
}

/// Everything counted for one key.
#[derive(Clone, Debug)]
pub(crate) struct KeyStats {
    pub requests: u64,
    pub admitted: u64,
    pub limited: u64,
    pub one_s: BusiestWindow,
    pub sixty_s: BusiestWindow,
    pub excess: Option<Excess>,
    /// The queue: the longest an admitted request waited, µs.
    pub longest_wait: Option<u64>,
}

impl KeyStats {
    pub fn new(rate: Option<Rate>, excess_from: u64) -> KeyStats {
        KeyStats {
            requests: 0,
            admitted: 0,
            limited: 0,
            one_s: BusiestWindow::new(US_PER_S),
            sixty_s: BusiestWindow::new(60 * US_PER_S),
            excess: rate.map(|r| Excess::new(r, excess_from)),
            longest_wait: None,
        }
    }

    #[inline]
    pub fn record(&mut self, t: u64, admitted: bool, tokens: u64) {
        self.requests += 1;
        if admitted {
            self.admitted += 1;
            self.one_s.admit(t);
            self.sixty_s.admit(t);
            if let Some(e) = &mut self.excess {
                e.admit(t, tokens);
            }
        } else {
            self.limited += 1;
        }
    }
}

/// One key in the summary.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KeySummary {
    pub requests: u64,
    pub admitted: u64,
    pub limited: u64,
    pub max_admitted_1s: u64,
    pub max_admitted_60s: u64,
    /// Tokens; `null` when the key has no rate to compare with or admitted nothing.
    pub worst_excess: Option<f64>,
    /// Lease design: tokens the gateways hold at the last row's time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_at_end: Option<u64>,
    /// Lease design: tokens in the store's bucket at the last row's time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket_at_end: Option<u64>,
    /// The queue: requests released (every admitted one is, after its wait).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released: Option<u64>,
    /// The queue: the longest an admitted request waited for its release, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub longest_wait_us: Option<u64>,
}

/// The whole replay, as `--json` prints it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub requests: u64,
    pub admitted: u64,
    pub limited: u64,
    /// Calls to the shared store: one per checked request for `central`, none for `local`
    /// and `shares` (in-process buckets), leases and give-backs for `lease`.
    pub store_calls: u64,
    pub keys: BTreeMap<String, KeySummary>,
    pub design: String,
    pub algorithm: String,
    pub limit: String,
    pub gateways: u64,
    /// Time of the first and last row, µs.
    pub first_us: Option<u64>,
    pub last_us: Option<u64>,
    /// Rows longer than the maximum line, or with a field over its bound: left out.
    pub too_long_rows: u64,
    /// Lease design: LEASE answers that granted a block, and that granted nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_grants: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_denials: Option<u64>,
    /// The queue: requests released, and the longest wait of any, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub longest_wait_us: Option<u64>,
    /// The edge design: what the rule blocked, and when.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub edge: Option<EdgeSummary>,
}

/// One block of the edge rule. Times are clock times of the trace (`09:00:40.000`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EdgeBlock {
    pub ip: String,
    /// The check that first saw the address over the limit, and scheduled the block.
    pub first_over_check: String,
    pub block_start: String,
    /// The check that scheduled the lift: the first not over the limit since the last one over
    /// it. `null` (with `block_end`) when the address was still over the limit at the end.
    pub first_under_check: Option<String>,
    pub block_end: Option<String>,
    /// The start of the first whole second whose arrivals from the address exceeded the rule's
    /// average rate, N/W.
    pub flood_start: Option<String>,
    /// Requests from the address that passed from `flood_start` until the block started.
    pub passed: Option<u64>,
    pub blocked: u64,
}

impl EdgeBlock {
    fn new(e: &EdgeRule, b: &Block) -> EdgeBlock {
        EdgeBlock {
            ip: e.address(b.addr).to_string(),
            first_over_check: clock(b.first_over_check),
            block_start: clock(b.start),
            first_under_check: b.first_under_check.map(clock),
            block_end: b.end.map(clock),
            flood_start: b.flood_start.map(clock),
            passed: b.passed,
            blocked: b.blocked,
        }
    }
}

/// The edge design's report: the first block's figures at the top, every block in `blocks`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EdgeSummary {
    /// N/W, per address.
    pub rule: String,
    pub check: String,
    pub delay: String,
    pub count_blocked: bool,
    pub ip: Option<String>,
    pub first_over_check: Option<String>,
    pub block_start: Option<String>,
    pub first_under_check: Option<String>,
    pub block_end: Option<String>,
    pub flood_start: Option<String>,
    pub passed: Option<u64>,
    /// Requests the rule let through, from every address, over the whole trace.
    pub passed_total: u64,
    /// Requests blocked over the whole trace, by key (keys with none are left out).
    pub blocked: BTreeMap<String, u64>,
    pub blocked_total: u64,
    pub blocks: Vec<EdgeBlock>,
}

impl EdgeSummary {
    pub(crate) fn new(
        e: &EdgeRule,
        blocks: &[Block],
        passed_total: u64,
        blocked: BTreeMap<String, u64>,
    ) -> EdgeSummary {
        let cfg = e.config();
        let blocks: Vec<EdgeBlock> = blocks.iter().map(|b| EdgeBlock::new(e, b)).collect();
        let first = blocks.first();
        EdgeSummary {
            rule: cfg.rule.to_string(),
            check: span(cfg.check_us),
            delay: span(cfg.delay_us),
            count_blocked: cfg.count_blocked,
            ip: first.map(|b| b.ip.clone()),
            first_over_check: first.map(|b| b.first_over_check.clone()),
            block_start: first.map(|b| b.block_start.clone()),
            first_under_check: first.and_then(|b| b.first_under_check.clone()),
            block_end: first.and_then(|b| b.block_end.clone()),
            flood_start: first.and_then(|b| b.flood_start.clone()),
            passed: first.and_then(|b| b.passed),
            passed_total,
            blocked_total: blocked.values().sum(),
            blocked,
            blocks,
        }
    }

    fn write(&self, out: &mut impl Write) -> io::Result<()> {
        let Some(first) = self.blocks.first() else {
            return writeln!(
                out,
                "the rule blocked nothing; {} passed",
                group(self.passed_total)
            );
        };
        writeln!(
            out,
            "first block: {} from {} to {} (over the limit at the {} check, {})",
            first.ip,
            first.block_start,
            first
                .block_end
                .as_deref()
                .unwrap_or("the end of the trace and on"),
            first.first_over_check,
            match &first.first_under_check {
                Some(c) => format!("back under at the {c} check"),
                None => "never back under".into(),
            }
        )?;
        match (&first.flood_start, first.passed) {
            (Some(f), Some(p)) => writeln!(
                out,
                "  the flood began at {f}: {} requests from the address passed before the block",
                group(p)
            )?,
            _ => writeln!(
                out,
                "  no whole second before the block went over the rule's average rate"
            )?,
        }
        let by_key: Vec<String> = self
            .blocked
            .iter()
            .map(|(k, n)| format!("{k} {}", group(*n)))
            .collect();
        writeln!(
            out,
            "blocked {} ({}), passed {}, in {} block{}",
            group(self.blocked_total),
            by_key.join(", "),
            group(self.passed_total),
            self.blocks.len(),
            if self.blocks.len() == 1 { "" } else { "s" }
        )?;
        if self.blocks.len() > 1 {
            for b in &self.blocks {
                writeln!(
                    out,
                    "  {}  {} to {}  blocked {}",
                    b.ip,
                    b.block_start,
                    b.block_end.as_deref().unwrap_or("the end"),
                    group(b.blocked)
                )?;
            }
        }
        Ok(())
    }
}

impl Summary {
    /// Store calls per second of trace time.
    pub fn store_calls_per_s(&self) -> Option<f64> {
        let (a, b) = (self.first_us?, self.last_us?);
        (b > a).then(|| self.store_calls as f64 * US_PER_S as f64 / (b - a) as f64)
    }

    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Several designs' summaries: a JSON array of the one-design objects, in `--design` order.
    pub(crate) fn many_to_json(all: &[Summary]) -> String {
        serde_json::to_string_pretty(all).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// The human table.
    pub(crate) fn write_table(&self, out: &mut impl Write) -> io::Result<()> {
        writeln!(
            out,
            "replay: design {}, algorithm {}, limit {}, {} gateways",
            self.design, self.algorithm, self.limit, self.gateways
        )?;
        write!(
            out,
            "rows {}  admitted {}  limited {}  store calls {}",
            group(self.requests),
            group(self.admitted),
            group(self.limited),
            group(self.store_calls)
        )?;
        if let Some(per_s) = self.store_calls_per_s() {
            write!(out, " ({per_s:.1}/s")?;
            if self.admitted > 0 {
                write!(
                    out,
                    ", {:.4} per admitted",
                    self.store_calls as f64 / self.admitted as f64
                )?;
            }
            write!(out, ")")?;
        }
        writeln!(out)?;
        if self.too_long_rows > 0 {
            writeln!(
                out,
                "skipped: {} too long (over {} bytes, or a field over its bound)",
                plural_rows(self.too_long_rows),
                group(MAX_LINE as u64)
            )?;
        }
        if let (Some(g), Some(d)) = (self.lease_grants, self.lease_denials) {
            writeln!(out, "leases granted {}  denied {}", group(g), group(d))?;
        }
        if let (Some(r), Some(w)) = (self.released, self.longest_wait_us) {
            writeln!(out, "released {}  longest wait {}", group(r), seconds(w))?;
        }
        if let Some(e) = &self.edge {
            e.write(out)?;
        }
        writeln!(out)?;
        // Keys are bounded as they are read; the cap keeps a width the formatter takes.
        let width = self
            .keys
            .keys()
            .map(|k| k.len())
            .max()
            .unwrap_or(3)
            .clamp(3, MAX_KEY_ID);
        let leased = self.keys.values().any(|k| k.held_at_end.is_some());
        let queued = self.keys.values().any(|k| k.longest_wait_us.is_some());
        write!(
            out,
            "{:<width$}  {:>12}  {:>12}  {:>12}  {:>8}  {:>9}  {:>12}",
            "key", "requests", "admitted", "limited", "max 1s", "max 60s", "worst excess"
        )?;
        if leased {
            write!(out, "  {:>13}  {:>13}", "held at end", "bucket at end")?;
        }
        if queued {
            write!(out, "  {:>12}", "longest wait")?;
        }
        writeln!(out)?;
        for (name, k) in &self.keys {
            let excess = k.worst_excess.map_or("-".to_string(), |e| format!("{e:.3}"));
            write!(
                out,
                "{:<width$}  {:>12}  {:>12}  {:>12}  {:>8}  {:>9}  {:>12}",
                name,
                group(k.requests),
                group(k.admitted),
                group(k.limited),
                group(k.max_admitted_1s),
                group(k.max_admitted_60s),
                excess
            )?;
            if leased {
                write!(
                    out,
                    "  {:>13}  {:>13}",
                    k.held_at_end.map_or("-".into(), group),
                    k.bucket_at_end.map_or("-".into(), group)
                )?;
            }
            if queued {
                write!(out, "  {:>12}", k.longest_wait_us.map_or("-".into(), seconds))?;
            }
            writeln!(out)?;
        }
        Ok(())
    }
}

fn plural_rows(n: u64) -> String {
    format!("{} {}", group(n), if n == 1 { "row" } else { "rows" })
}

/// µs as seconds to the µs: `2000000` → `2.000000 s`.
fn seconds(us: u64) -> String {
    format!("{}.{:06} s", us / US_PER_S, us % US_PER_S)
}

/// µs since midnight as a clock time, to the ms unless the µs say more: `09:00:40.000`.
pub(crate) fn clock(us: u64) -> String {
    let s = us / US_PER_S;
    let (h, m, s) = (s / 3_600, s / 60 % 60, s % 60);
    let frac = us % US_PER_S;
    if frac.is_multiple_of(1_000) {
        format!("{h:02}:{m:02}:{s:02}.{:03}", frac / 1_000)
    } else {
        format!("{h:02}:{m:02}:{s:02}.{frac:06}")
    }
}

/// `48615` → `48,615`.
pub(crate) fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Writes `admitted,retry_after` rows: `1,0` when admitted, `0,N` when limited, `0,` when no
/// wait can help. With several designs each row holds one such pair per design, under headers
/// named after them (`central_admitted,central_retry_after,local_admitted,…`). A design that
/// runs the queue adds `wait_us` after its pair: the µs an admitted request waited for its
/// release, empty for a refused one.
///
/// A request the edge rule blocked waits for its Retry-After until the block has lifted, later
/// in the trace: its row and every row after it are held until then, so rows stay in trace order.
pub(crate) struct DecisionWriter<W: Write> {
    out: W,
    /// Whether each design, in column order, has a `wait_us` column.
    waits: Vec<bool>,
    held: VecDeque<(u64, Vec<Verdict>)>,
}

/// When the block an edge design (by column index) refused a request with ends, once certain.
pub(crate) type BlockEnds<'a> = dyn FnMut(usize, u32) -> Option<u64> + 'a;

impl<W: Write> DecisionWriter<W> {
    /// `designs` names the columns, each with whether it has `wait_us`; with one design the
    /// header is plain, as it always was.
    pub fn new(mut out: W, designs: &[(&str, bool)]) -> io::Result<DecisionWriter<W>> {
        let plain = designs.len() <= 1;
        let header: Vec<String> = designs
            .iter()
            .map(|&(d, wait)| {
                let p = if plain { String::new() } else { format!("{d}_") };
                let pair = format!("{p}admitted,{p}retry_after");
                if wait { format!("{pair},{p}wait_us") } else { pair }
            })
            .collect();
        let header = if header.is_empty() {
            "admitted,retry_after".to_string()
        } else {
            header.join(",")
        };
        out.write_all(header.as_bytes())?;
        out.write_all(b"\n")?;
        Ok(DecisionWriter {
            out,
            waits: designs.iter().map(|d| d.1).collect(),
            held: VecDeque::new(),
        })
    }

    /// One trace row at `time_us`: each design's verdict, in the header's order.
    #[inline]
    pub fn write(&mut self, time_us: u64, verdicts: &[Verdict], ends: &mut BlockEnds<'_>) -> io::Result<()> {
        if self.held.is_empty() && verdicts.iter().all(|v| v.block.is_none()) {
            return self.row(verdicts);
        }
        self.held.push_back((time_us, verdicts.to_vec()));
        while let Some((t, vs)) = self.held.front_mut() {
            for (i, v) in vs.iter_mut().enumerate() {
                if let Some(b) = v.block {
                    let Some(end) = ends(i, b) else {
                        return Ok(());
                    };
                    v.retry_after = Some(retry_after_secs(end.saturating_sub(*t)));
                    v.block = None;
                }
            }
            if let Some((_, vs)) = self.held.pop_front() {
                self.row(&vs)?;
            }
        }
        Ok(())
    }

    fn row(&mut self, verdicts: &[Verdict]) -> io::Result<()> {
        for (i, v) in verdicts.iter().enumerate() {
            if i > 0 {
                self.out.write_all(b",")?;
            }
            self.pair(v.admitted, v.retry_after)?;
            if self.waits.get(i).copied().unwrap_or(false) {
                self.out.write_all(b",")?;
                if let Some(w) = v.wait_us {
                    self.out.write_all(itoa::Buffer::new().format(w).as_bytes())?;
                }
            }
        }
        self.out.write_all(b"\n")
    }

    #[inline]
    fn pair(&mut self, admitted: bool, retry_after: Option<u64>) -> io::Result<()> {
        if admitted {
            return self.out.write_all(b"1,0");
        }
        match retry_after {
            None => self.out.write_all(b"0,"),
            Some(s) => {
                let mut buf = itoa::Buffer::new();
                self.out.write_all(b"0,")?;
                self.out.write_all(buf.format(s).as_bytes())
            }
        }
    }

    /// Writes the rows still held, now that the trace is over: a block with no lift in sight
    /// leaves its Retry-After empty.
    pub fn finish(mut self, ends: &mut BlockEnds<'_>) -> io::Result<W> {
        while let Some((t, mut vs)) = self.held.pop_front() {
            for (i, v) in vs.iter_mut().enumerate() {
                if let Some(b) = v.block.take() {
                    v.retry_after = ends(i, b).map(|end| retry_after_secs(end.saturating_sub(t)));
                }
            }
            self.row(&vs)?;
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busiest_window_is_half_open() {
        let mut w = BusiestWindow::new(1_000_000);
        for t in [0, 500_000, 999_999, 1_000_000] {
            w.admit(t);
        }
        // [0, 1 s) holds three; the one at exactly 1 s starts the next window.
        assert_eq!(w.max(), 3);
    }

    #[test]
    fn excess_is_exact() {
        // 10/s: 20 at once then one every 100 ms: the worst is the burst, 20 − 0.
        let rate = Rate::parse("10/1s").unwrap();
        let mut e = Excess::new(rate, 0);
        for _ in 0..20 {
            e.admit(1_000_000, 1);
        }
        for i in 1..=50 {
            e.admit(1_000_000 + i * 100_000, 1);
        }
        assert_eq!(e.value(), Some(20.0));
        // Intervals starting after the burst: one token, no interval longer gains.
        let mut late = Excess::new(rate, 1_000_001);
        for i in 0..=50 {
            late.admit(1_000_000 + i * 100_000, 1);
        }
        assert_eq!(late.value(), Some(1.0));
        assert_eq!(group(1_234_567), "1,234,567");
        assert_eq!(group(12), "12");
    }

    #[test]
    fn rows_wait_for_the_end_of_the_block_that_refused_them() {
        let blocked = |b| Verdict {
            block: Some(b),
            ..Verdict::refuse(None)
        };
        let waited = Verdict::released_after(250);
        let mut w = DecisionWriter::new(Vec::new(), &[("edge", false), ("central", true)]).unwrap();
        let mut end: Option<u64> = None;
        w.write(1_000_000, &[Verdict::ALLOW, waited], &mut |_, _| end)
            .unwrap();
        w.write(
            2_000_000,
            &[blocked(0), Verdict::refuse(Some(10))],
            &mut |_, _| end,
        )
        .unwrap();
        w.write(3_000_000, &[Verdict::ALLOW, waited], &mut |_, _| end)
            .unwrap();
        assert_eq!(w.held.len(), 2);
        end = Some(4_500_000);
        w.write(5_000_000, &[blocked(1), waited], &mut |_, b| {
            end.filter(|_| b == 0)
        })
        .unwrap();
        assert_eq!(w.held.len(), 1);
        let out = w.finish(&mut |_, _| None).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "edge_admitted,edge_retry_after,central_admitted,central_retry_after,central_wait_us\n\
             1,0,1,0,250\n0,3,0,1,\n1,0,1,0,250\n0,,1,0,250\n"
        );
    }
}
