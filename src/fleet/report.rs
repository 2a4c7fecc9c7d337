//! What a fleet run reports, per mode: the storm key's admissions (per second, busiest 1 s and
//! 60 s, totals) against its contract's bound b + r·t over the same span, the rate the harness
//! really offered, the other partners' errors, the gateways' store bypasses, and, for a store
//! outage, what passed while the store was away. Text side by side, or `--json`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::load::{Answer, NO_ANSWER, STORM};
use super::rules::Contract;
use tollgate_limit::bucket::US_PER_S;
use tollgate_replay::report::BusiestWindow;

/// Below this share of the target rate the report says the machine could not drive the storm.
pub(crate) const REACHED: f64 = 0.9;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

fn latency(mut us: Vec<u64>) -> Latency {
    if us.is_empty() {
        return Latency::default();
    }
    us.sort_unstable();
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
    Latency {
        p50_ms: at(0.50),
        p99_ms: at(0.99),
        max_ms: at(1.0),
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Storm {
    pub requests: u64,
    pub admitted: u64,
    pub limited_429: u64,
    /// Statuses other than 2xx and 429, by code.
    pub other_statuses: BTreeMap<u16, u64>,
    pub no_answer: u64,
    /// First request sent to last answer, seconds: the span the bound is taken over.
    pub span_s: f64,
    /// Storm requests sent per second of the run.
    pub offered_per_s: f64,
    /// What the workers offer when every answer beats the padding; none when flooding.
    pub target_per_s: Option<f64>,
    /// The offered rate reached at least 90% of the target (always true when flooding).
    pub reached_target: bool,
    /// The contract's bound for the span: b + r·t.
    pub contract_bound: f64,
    pub admitted_over_contract: f64,
    /// What N separate full buckets could admit: N·(b + r·t).
    pub local_bound: f64,
    pub max_admitted_1s: u64,
    pub max_admitted_60s: u64,
    /// b + r·1 s and b + r·60 s.
    pub bound_1s: f64,
    pub bound_60s: f64,
    /// Admitted answers per second of the run, by answer time.
    pub admitted_per_s: Vec<u64>,
    pub latency: Latency,
}

#[derive(Clone, Debug, Serialize)]
pub struct Others {
    pub requests: u64,
    pub ok: u64,
    pub limited_429: u64,
    /// Non-2xx other than 429, plus requests with no answer.
    pub errors: u64,
    pub statuses: BTreeMap<u16, u64>,
    pub no_answer: u64,
    pub latency: Latency,
}

/// Counters summed over the gateways' /metrics at the end of a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StoreCounters {
    /// `tollgate_store_bypass_total` by `limit/policy`.
    pub bypass: BTreeMap<String, u64>,
    /// `tollgate_store_errors_total` by kind.
    pub errors: BTreeMap<String, u64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Outage {
    pub stopped_at_s: f64,
    pub resumed_at_s: f64,
    pub length_s: f64,
    /// From the stop to one probe interval (1 s) after the resume: every breaker has closed.
    pub degraded_window_s: f64,
    pub storm_requests_in_outage: u64,
    pub storm_admitted_in_outage: u64,
    pub storm_admitted_in_degraded_window: u64,
    pub others_requests_in_degraded_window: u64,
    /// Non-2xx answers to the other partners in the degraded window.
    pub others_not_admitted_in_degraded_window: u64,
    /// What this setup should give, by the policy's arithmetic over the outage's length.
    pub expected: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub run: String,
    pub mode: &'static str,
    pub policy: Option<&'static str>,
    pub load_average_before: String,
    pub load_average_after: String,
    pub storm: Storm,
    pub others: Others,
    pub store: StoreCounters,
    pub outage: Option<Outage>,
    /// One body (or transport error) for each status other than 2xx and 429 (0: no answer).
    pub unexpected_answers: BTreeMap<u16, String>,
}

/// What the analysis needs besides the answers.
pub(crate) struct RunFacts<'a> {
    pub run: String,
    pub mode: &'static str,
    pub policy: Option<&'static str>,
    pub gateways: u32,
    pub duration_us: u64,
    pub target_per_s: Option<f64>,
    pub others_rate: u32,
    pub contract: &'a Contract,
    pub outage_us: Option<(u64, u64)>,
    pub load_before: String,
    pub load_after: String,
    pub store: StoreCounters,
    pub samples: BTreeMap<u16, String>,
}

fn ok(status: u16) -> bool {
    (200..300).contains(&status)
}

pub(crate) fn analyse(answers: &[Answer], f: RunFacts<'_>) -> RunReport {
    let mut storm: Vec<&Answer> = answers.iter().filter(|r| r.who == STORM).collect();
    storm.sort_by_key(|r| r.recv_us);
    let others: Vec<&Answer> = answers.iter().filter(|r| r.who != STORM).collect();
    let storm_report = storm_report(&storm, &f);
    let outage = f
        .outage_us
        .map(|window| outage_report(window, &storm, &others, &f, storm_report.offered_per_s));
    RunReport {
        run: f.run,
        mode: f.mode,
        policy: f.policy,
        load_average_before: f.load_before,
        load_average_after: f.load_after,
        storm: storm_report,
        others: others_report(&others),
        store: f.store,
        outage,
        unexpected_answers: f.samples,
    }
}

/// The storm key's answers, sorted by answer time, against its contract's bound.
fn storm_report(storm: &[&Answer], f: &RunFacts<'_>) -> Storm {
    let first_send = storm.iter().map(|r| r.send_us).min().unwrap_or(0);
    let last_recv = storm.iter().map(|r| r.recv_us).max().unwrap_or(0);
    let span_us = last_recv.saturating_sub(first_send);
    let mut other_statuses = BTreeMap::new();
    let (mut admitted, mut limited, mut no_answer) = (0, 0, 0);
    let secs = (f.duration_us / US_PER_S + 1) as usize;
    let mut per_s = vec![0u64; secs];
    let mut one = BusiestWindow::new(US_PER_S);
    let mut sixty = BusiestWindow::new(60 * US_PER_S);
    for r in storm {
        match r.status {
            s if ok(s) => {
                admitted += 1;
                let i = (r.recv_us / US_PER_S) as usize;
                if i >= per_s.len() {
                    per_s.resize(i + 1, 0);
                }
                per_s[i] += 1;
                one.admit(r.recv_us);
                sixty.admit(r.recv_us);
            }
            429 => limited += 1,
            NO_ANSWER => no_answer += 1,
            s => *other_statuses.entry(s).or_insert(0) += 1,
        }
    }
    let offered = storm.len() as f64 / (f.duration_us as f64 / US_PER_S as f64);
    let bound = f.contract.bound(span_us);
    Storm {
        requests: storm.len() as u64,
        admitted,
        limited_429: limited,
        other_statuses,
        no_answer,
        span_s: span_us as f64 / US_PER_S as f64,
        offered_per_s: offered,
        target_per_s: f.target_per_s,
        reached_target: f.target_per_s.is_none_or(|t| offered >= REACHED * t),
        contract_bound: bound,
        admitted_over_contract: if bound > 0.0 { admitted as f64 / bound } else { 0.0 },
        local_bound: bound * f64::from(f.gateways),
        max_admitted_1s: one.max(),
        max_admitted_60s: sixty.max(),
        bound_1s: f.contract.bound(US_PER_S),
        bound_60s: f.contract.bound(60 * US_PER_S),
        admitted_per_s: per_s,
        latency: latency(storm.iter().map(|r| r.recv_us - r.send_us).collect()),
    }
}

/// The other partners' answers: a request without an answer counts as an error.
fn others_report(others: &[&Answer]) -> Others {
    let mut statuses = BTreeMap::new();
    let (mut o_ok, mut o_429, mut o_err, mut o_none) = (0, 0, 0, 0);
    for r in others {
        match r.status {
            s if ok(s) => o_ok += 1,
            429 => o_429 += 1,
            NO_ANSWER => {
                o_none += 1;
                o_err += 1;
            }
            _ => o_err += 1,
        }
        if r.status != NO_ANSWER {
            *statuses.entry(r.status).or_insert(0) += 1;
        }
    }
    Others {
        requests: others.len() as u64,
        ok: o_ok,
        limited_429: o_429,
        errors: o_err,
        statuses,
        no_answer: o_none,
        latency: latency(others.iter().map(|r| r.recv_us - r.send_us).collect()),
    }
}

/// What passed while the store was stopped, from `stop` to `resume`, and in the degraded window
/// that runs on until every breaker has closed.
fn outage_report(
    (stop, resume): (u64, u64),
    storm: &[&Answer],
    others: &[&Answer],
    f: &RunFacts<'_>,
    offered: f64,
) -> Outage {
    let degraded_end = resume + US_PER_S;
    let in_out = |r: &&&Answer| r.recv_us >= stop && r.recv_us < resume;
    let in_deg = |r: &&&Answer| r.recv_us >= stop && r.recv_us < degraded_end;
    let length_s = (resume - stop) as f64 / US_PER_S as f64;
    Outage {
        stopped_at_s: stop as f64 / US_PER_S as f64,
        resumed_at_s: resume as f64 / US_PER_S as f64,
        length_s,
        degraded_window_s: (degraded_end - stop) as f64 / US_PER_S as f64,
        storm_requests_in_outage: storm.iter().filter(in_out).count() as u64,
        storm_admitted_in_outage: storm.iter().filter(in_out).filter(|r| ok(r.status)).count() as u64,
        storm_admitted_in_degraded_window: storm.iter().filter(in_deg).filter(|r| ok(r.status)).count()
            as u64,
        others_requests_in_degraded_window: others.iter().filter(in_deg).count() as u64,
        others_not_admitted_in_degraded_window: others.iter().filter(in_deg).filter(|r| !ok(r.status)).count()
            as u64,
        expected: expected_in_outage(f, offered, length_s),
    }
}

/// What the failure policy's arithmetic says an outage of `length_s` should let through.
fn expected_in_outage(f: &RunFacts<'_>, offered: f64, length_s: f64) -> String {
    let n = f64::from(f.gateways);
    match f.policy {
        Some("open") => format!(
            "every storm request admitted: {offered:.0}/s x {length_s:.1} s = {:.0}",
            offered * length_s
        ),
        Some("closed") => format!(
            "every other partner unavailable (503): {}/s x {length_s:.1} s = {:.0}",
            f.others_rate,
            f64::from(f.others_rate) * length_s
        ),
        Some("local") => {
            let b = (f.contract.burst / u64::from(f.gateways)).max(1) as f64;
            let r = f.contract.per_second() / n;
            format!(
                "local shares: {n} x ({b} + {r} x {length_s:.1} s) = {:.0} storm admissions, every other partner admitted",
                n * (b + r * length_s)
            )
        }
        _ => String::new(),
    }
}

/// Sums `tollgate_store_bypass_total` and `tollgate_store_errors_total` from one /metrics text.
pub fn scrape(text: &str, into: &mut StoreCounters) {
    for line in text.lines() {
        let (target, labels) = if let Some(rest) = line.strip_prefix("tollgate_store_bypass_total{") {
            (&mut into.bypass, rest)
        } else if let Some(rest) = line.strip_prefix("tollgate_store_errors_total{") {
            (&mut into.errors, rest)
        } else {
            continue;
        };
        let Some((labels, value)) = labels.rsplit_once('}') else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        let name: Vec<&str> = labels
            .split(',')
            .filter_map(|kv| kv.split_once('=').map(|(_, v)| v.trim_matches('"')))
            .collect();
        *target.entry(name.join("/")).or_insert(0) += v as u64;
    }
}

/// `39 10x118 3`: runs of equal seconds collapsed.
pub(crate) fn compact(series: &[u64]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < series.len() {
        let mut j = i;
        while j < series.len() && series[j] == series[i] {
            j += 1;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        if j - i > 1 {
            let _ = write!(out, "{}x{}", series[i], j - i);
        } else {
            let _ = write!(out, "{}", series[i]);
        }
        i = j;
    }
    out
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn map_text(m: &BTreeMap<impl std::fmt::Display, u64>) -> String {
    if m.is_empty() {
        return "0".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k}:{v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The side-by-side table, the per-second series, warnings, and a store outage's lines.
pub fn text(header: &str, runs: &[RunReport]) -> String {
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut row = |name: &str, f: &dyn Fn(&RunReport) -> String| {
        rows.push((name.to_string(), runs.iter().map(f).collect()));
    };
    row("", &|r| r.run.clone());
    row("storm requests", &|r| thousands(r.storm.requests));
    row("storm admitted", &|r| thousands(r.storm.admitted));
    row("contract b + r*t", &|r| format!("{:.0}", r.storm.contract_bound));
    row("admitted / contract", &|r| {
        format!("{:.2}", r.storm.admitted_over_contract)
    });
    row("span t (s)", &|r| format!("{:.2}", r.storm.span_s));
    row("max admitted in 1 s", &|r| {
        format!("{} (b+r: {:.0})", r.storm.max_admitted_1s, r.storm.bound_1s)
    });
    row("max admitted in 60 s", &|r| {
        format!(
            "{} (b+60r: {:.0})",
            thousands(r.storm.max_admitted_60s),
            r.storm.bound_60s
        )
    });
    row("storm 429", &|r| thousands(r.storm.limited_429));
    row("storm other / no answer", &|r| {
        format!("{} / {}", map_text(&r.storm.other_statuses), r.storm.no_answer)
    });
    row("offered / target (/s)", &|r| match r.storm.target_per_s {
        Some(t) => format!("{:.1} / {t:.0}", r.storm.offered_per_s),
        None => format!("{:.1} / flood", r.storm.offered_per_s),
    });
    row("storm latency p50/p99 ms", &|r| {
        format!("{:.1} / {:.1}", r.storm.latency.p50_ms, r.storm.latency.p99_ms)
    });
    row("others requests", &|r| thousands(r.others.requests));
    row("others 2xx", &|r| thousands(r.others.ok));
    row("others 429", &|r| thousands(r.others.limited_429));
    row("others errors (non-429)", &|r| thousands(r.others.errors));
    row("others latency p50/p99 ms", &|r| {
        format!("{:.1} / {:.1}", r.others.latency.p50_ms, r.others.latency.p99_ms)
    });
    row("store bypasses", &|r| map_text(&r.store.bypass));
    row("store errors", &|r| map_text(&r.store.errors));
    row("load average before", &|r| r.load_average_before.clone());
    if runs.iter().any(|r| r.outage.is_some()) {
        row("outage (s)", &|r| {
            r.outage.as_ref().map_or(String::new(), |o| {
                format!("{:.1}..{:.1}", o.stopped_at_s, o.resumed_at_s)
            })
        });
        row("storm admitted in outage", &|r| {
            r.outage.as_ref().map_or(String::new(), |o| {
                format!("{} of {}", o.storm_admitted_in_outage, o.storm_requests_in_outage)
            })
        });
        row("... to resume + 1 s", &|r| {
            r.outage
                .as_ref()
                .map_or(String::new(), |o| o.storm_admitted_in_degraded_window.to_string())
        });
        row("others not admitted, same window", &|r| {
            r.outage.as_ref().map_or(String::new(), |o| {
                format!(
                    "{} of {}",
                    o.others_not_admitted_in_degraded_window, o.others_requests_in_degraded_window
                )
            })
        });
    }
    let w0 = rows.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..runs.len())
        .map(|i| rows.iter().map(|(_, v)| v[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    let _ = writeln!(out, "{header}");
    for (name, vals) in &rows {
        let _ = write!(out, "{name:<w0$}");
        for (v, w) in vals.iter().zip(&widths) {
            let _ = write!(out, "  {v:>w$}");
        }
        out.push('\n');
    }
    out.push_str("\nstorm admitted per second (by answer time; AxB = A for B seconds):\n");
    for r in runs {
        let _ = writeln!(out, "  {:<14} {}", r.run, compact(&r.storm.admitted_per_s));
    }
    for r in runs {
        if let Some(o) = &r.outage {
            let _ = writeln!(out, "{}: expected {}", r.run, o.expected);
        }
    }
    for r in runs {
        for (status, text) in &r.unexpected_answers {
            let what = if *status == NO_ANSWER {
                "no answer".to_string()
            } else {
                format!("an answer {status}")
            };
            let _ = writeln!(out, "{}: {what}: {text}", r.run);
        }
    }
    for r in runs {
        if !r.storm.reached_target {
            let _ = writeln!(
                out,
                "WARNING {}: the harness offered {:.1}/s, below {:.0}% of the storm's {:.0}/s: this machine could not \
                 drive the storm, and the figures understate what a real storm would get",
                r.run,
                r.storm.offered_per_s,
                REACHED * 100.0,
                r.storm.target_per_s.unwrap_or(0.0)
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_limit::bucket::Rate;

    fn contract() -> Contract {
        Contract {
            limit: "plan".into(),
            rate: "600/60s".into(),
            burst: 20,
            cost: 1,
            per_second: 10.0,
            parsed: Rate::parse("600/60s").unwrap(),
        }
    }

    fn answer(send_s: f64, status: u16, who: u16) -> Answer {
        let t = (send_s * 1e6) as u64;
        Answer {
            send_us: t,
            recv_us: t + 1_000,
            gateway: 0,
            who,
            status,
        }
    }

    #[test]
    fn counts_windows_and_the_bound() {
        let c = contract();
        let mut answers = Vec::new();
        // 25 admitted in the first 0.5 s, then one a second for 9 s; all sent at 10/s.
        for i in 0..25 {
            answers.push(answer(i as f64 * 0.02, 200, STORM));
        }
        for i in 1..10 {
            answers.push(answer(i as f64, 200, STORM));
            answers.push(answer(i as f64 + 0.5, 429, STORM));
        }
        answers.push(answer(3.3, 503, STORM));
        answers.push(answer(3.4, NO_ANSWER, STORM));
        answers.push(answer(1.0, 200, 1));
        answers.push(answer(1.1, 429, 1));
        answers.push(answer(1.2, 503, 2));
        answers.push(answer(1.3, NO_ANSWER, 2));
        let r = analyse(
            &answers,
            RunFacts {
                run: "central".into(),
                mode: "central",
                policy: None,
                gateways: 20,
                duration_us: 10 * US_PER_S,
                target_per_s: Some(4.0),
                others_rate: 4,
                contract: &c,
                outage_us: None,
                load_before: String::new(),
                load_after: String::new(),
                store: StoreCounters::default(),
                samples: BTreeMap::new(),
            },
        );
        let s = &r.storm;
        assert_eq!(
            (s.requests, s.admitted, s.limited_429, s.no_answer),
            (45, 34, 9, 1)
        );
        assert_eq!(s.other_statuses.get(&503), Some(&1));
        assert_eq!(s.max_admitted_1s, 25);
        assert_eq!(s.max_admitted_60s, 34);
        assert_eq!(s.admitted_per_s[..3], [25, 1, 1]);
        // First send 0 s, last answer 9.501 s.
        assert!((s.span_s - 9.501).abs() < 1e-9);
        assert!((s.contract_bound - (20.0 + 95.01)).abs() < 1e-9);
        assert!((s.offered_per_s - 4.5).abs() < 1e-9);
        assert!(s.reached_target);
        let o = &r.others;
        assert_eq!(
            (o.requests, o.ok, o.limited_429, o.errors, o.no_answer),
            (4, 1, 1, 2, 1)
        );
        assert_eq!(compact(&[39, 10, 10, 10, 3]), "39 10x3 3");
    }

    #[test]
    fn a_slow_harness_is_flagged() {
        let c = contract();
        let answers: Vec<Answer> = (0..10).map(|i| answer(i as f64, 429, STORM)).collect();
        let r = analyse(
            &answers,
            RunFacts {
                run: "local".into(),
                mode: "local",
                policy: None,
                gateways: 20,
                duration_us: 10 * US_PER_S,
                target_per_s: Some(400.0),
                others_rate: 0,
                contract: &c,
                outage_us: None,
                load_before: String::new(),
                load_after: String::new(),
                store: StoreCounters::default(),
                samples: BTreeMap::new(),
            },
        );
        assert!(!r.storm.reached_target);
        assert!(text("h", &[r]).contains("WARNING local: the harness offered 1.0/s"));
    }

    #[test]
    fn scrapes_bypass_and_error_counters() {
        let mut c = StoreCounters::default();
        let text = "# TYPE tollgate_store_bypass counter\n\
            tollgate_store_bypass_total{limit=\"plan\",policy=\"open\"} 12\n\
            tollgate_store_errors_total{kind=\"timeout\"} 5\n\
            tollgate_store_bypass_created{limit=\"plan\",policy=\"open\"} 1.7e9\n";
        scrape(text, &mut c);
        scrape(text, &mut c);
        assert_eq!(c.bypass.get("plan/open"), Some(&24));
        assert_eq!(c.errors.get("timeout"), Some(&10));
        assert_eq!(c.bypass.len(), 1);
    }
}
