//! What a replay reports: per-key counts, the busiest 1 s and 60 s, the worst excess over the
//! rate, the queue's longest wait, and the outputs built from them (the human table, `--json`,
//! `--decisions` CSV).
//!
//! Busiest windows are sliding and half-open, `[s, s + w)`, over every start `s`; the worst
//! excess is the supremum of `admitted − r·t` over every interval, computed exactly in units
//! of `1 / P` token and in one pass.

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, Write};

use serde::Serialize;

use super::algorithms::Verdict;

use tollgate_limit::bucket::{Rate, US_PER_S};

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
        if let (Some(g), Some(d)) = (self.lease_grants, self.lease_denials) {
            writeln!(out, "leases granted {}  denied {}", group(g), group(d))?;
        }
        if let (Some(r), Some(w)) = (self.released, self.longest_wait_us) {
            writeln!(out, "released {}  longest wait {}", group(r), seconds(w))?;
        }
        writeln!(out)?;
        let width = self.keys.keys().map(|k| k.len()).max().unwrap_or(3).max(3);
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

/// µs as seconds to the µs: `2000000` → `2.000000 s`.
fn seconds(us: u64) -> String {
    format!("{}.{:06} s", us / US_PER_S, us % US_PER_S)
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
pub(crate) struct DecisionWriter<W: Write> {
    out: W,
    /// Whether each design, in column order, has a `wait_us` column.
    waits: Vec<bool>,
}

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
        })
    }

    /// One trace row: each design's verdict, in the header's order.
    #[inline]
    pub fn write(&mut self, verdicts: &[Verdict]) -> io::Result<()> {
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

    pub fn finish(mut self) -> io::Result<W> {
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
}
