//! Generated traces replayed through the `tollgate-replay` library, for the tests that hold
//! `tollgate replay` to the figures worked out by hand: settings for one limit, a replay's
//! verdict per row, and the storm's window.

use tollgate_limit::bucket::Rate;
use tollgate_replay::algorithms::Verdict;
use tollgate_replay::generate::{self, GenRow, STORM_END_US, STORM_START_US};
use tollgate_replay::report::Summary;
use tollgate_replay::{Algorithm, Design, Replay, Request, Settings};

pub fn settings(rate: &str, burst: Option<u64>, algorithm: Algorithm, design: Design) -> Settings {
    let mut s = Settings::single(Rate::parse(rate).unwrap(), burst);
    s.algorithm = algorithm;
    s.design = design;
    s.gateways = 20;
    s
}

/// Replays generated rows through the library; returns (time, verdict) per row and the summary.
pub fn run(s: Settings, rows: impl IntoIterator<Item = GenRow>) -> (Vec<(u64, Verdict)>, Summary, Replay) {
    let mut replay = Replay::new(s).expect("valid settings");
    let mut out = Vec::new();
    for r in rows {
        let v = replay
            .check(&Request {
                time_us: r.time_us,
                key: r.key,
                gateway: Some(r.gateway),
                ..Request::default()
            })
            .expect("valid row");
        out.push((r.time_us, v));
    }
    let summary = replay.summary();
    (out, summary, replay)
}

pub fn in_storm(t: u64) -> bool {
    (STORM_START_US..STORM_END_US).contains(&t)
}

pub fn admitted_between(d: &[(u64, Verdict)], from: u64, to_excl: u64) -> usize {
    d.iter()
        .filter(|(t, v)| (from..to_excl).contains(t) && v.admitted)
        .count()
}

pub fn storm(algorithm: Algorithm, design: Design) -> (Vec<(u64, Verdict)>, Summary, Replay) {
    let burst = matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra).then_some(20);
    run(settings("600/60s", burst, algorithm, design), generate::storm(20))
}
