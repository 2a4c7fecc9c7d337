//! The fluid model of one limit across Regions A, B and C: demand as a smooth flow in 10 ms
//! steps, a token bucket per Region that refills at its share, records that reach the other
//! Regions a second after they are written, and the agents of `agent` deciding at each
//! rebalance. It checks the room ledger at every step and measures admissions against the
//! contract's burst + rate × time.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::str::FromStr;

use serde::Serialize;

use crate::agent::{Agent, Design, Params, ReclaimRule, ShareRecord, View};

/// The model's step.
const STEP_S: f64 = 0.01;
/// Steps per second.
const HZ: i64 = 100;
/// Every Region rebalances this often, in steps.
const INTERVAL: i64 = 5 * HZ;
/// A record written at one instant is read elsewhere this much later, in steps.
const DELAY: i64 = HZ;
/// The contract: 10,000 a second with a burst of 20,000.
const LIMIT: f64 = 10_000.0;
const BURST: f64 = 20_000.0;
/// Slack for sums of floating-point room.
const EPS: f64 = 1e-6;

pub const REGIONS: [&str; 3] = ["A", "B", "C"];

/// The model's named runs: a shift in demand between the Regions, then Region B lost or cut off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Run {
    /// At 14:00 C's demand rises from 1,200 to 7,200; room moves by named grants.
    DemandShift,
    /// The same shift, with every Region jumping to its new target at once.
    DemandShiftJump,
    /// A's demand falls to 1,200 while B's and C's rise to 7,200, all three rebalancing at the
    /// same instants.
    AllAtOnce,
    /// The demand shift, then B lost at 14:05 holding 2,200; its share stays counted.
    LostRegionFreeze,
    /// B lost; the others reclaim its share on silence and a failing health check.
    LostRegionTwoSignals,
    /// B only cut off; every Region reclaims on silence alone.
    CutOffSilence,
    /// B only cut off; the health check passes, so nobody reclaims.
    CutOffTwoSignals,
}

/// A run name that is not one of the model's.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown run {0:?}; one of demand-shift, demand-shift-jump, all-at-once, lost-region-freeze, \
     lost-region-two-signals, cut-off-silence, cut-off-two-signals"
)]
pub struct UnknownRun(pub String);

impl Run {
    pub const ALL: [Run; 7] = [
        Run::DemandShift,
        Run::DemandShiftJump,
        Run::AllAtOnce,
        Run::LostRegionFreeze,
        Run::LostRegionTwoSignals,
        Run::CutOffSilence,
        Run::CutOffTwoSignals,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Run::DemandShift => "demand-shift",
            Run::DemandShiftJump => "demand-shift-jump",
            Run::AllAtOnce => "all-at-once",
            Run::LostRegionFreeze => "lost-region-freeze",
            Run::LostRegionTwoSignals => "lost-region-two-signals",
            Run::CutOffSilence => "cut-off-silence",
            Run::CutOffTwoSignals => "cut-off-two-signals",
        }
    }

    /// The names an earlier release printed, still accepted by `--run`.
    fn old_name(self) -> &'static str {
        match self {
            Run::DemandShift => "G1",
            Run::DemandShiftJump => "G1-naive",
            Run::AllAtOnce => "G1c",
            Run::LostRegionFreeze => "G2-freeze",
            Run::LostRegionTwoSignals => "G2-two-signals",
            Run::CutOffSilence => "G2-silence",
            Run::CutOffTwoSignals => "G2-cut-two-signals",
        }
    }

    pub fn scenario(self) -> Scenario {
        // 13:59: shares set for demands 7,200, 3,600 and 1,200.
        let shift = Scenario {
            run: self.name(),
            design: Design::NamedGrants,
            rule: ReclaimRule::TwoSignals,
            offsets: [0, 170, 330],
            seconds: 40,
            demand: [7_200.0, 3_600.0, 1_200.0],
            share: [5_600.0, 3_050.0, 1_350.0],
            changes: vec![(0, 2, 7_200.0)],
            loss: None,
            split_silent_by: None,
        };
        // The demand shift, then B lost or cut off at 14:05:00 with 2,200.
        let b_lost = |rule, kind: LossKind| {
            let mut s = Scenario {
                run: self.name(),
                rule,
                seconds: 7 * 60,
                loss: Some(Loss {
                    region: 1,
                    at: 300 * HZ,
                    kind,
                    unhealthy_from: (kind == LossKind::Lost).then_some(330 * HZ),
                }),
                ..shift.clone()
            };
            // A lost B's clients fail for a minute, then arrive in A.
            if kind == LossKind::Lost {
                s.changes.push((360 * HZ, 0, 10_800.0));
            }
            s
        };
        match self {
            Run::DemandShift => shift,
            Run::DemandShiftJump => Scenario {
                design: Design::Jump,
                ..shift
            },
            Run::AllAtOnce => Scenario {
                offsets: [0, 0, 0],
                changes: vec![(0, 0, 1_200.0), (0, 1, 7_200.0), (0, 2, 7_200.0)],
                ..shift
            },
            Run::LostRegionFreeze => b_lost(ReclaimRule::Freeze, LossKind::Lost),
            Run::LostRegionTwoSignals => b_lost(ReclaimRule::TwoSignals, LossKind::Lost),
            Run::CutOffSilence => b_lost(ReclaimRule::Silence, LossKind::CutOff),
            Run::CutOffTwoSignals => b_lost(ReclaimRule::TwoSignals, LossKind::CutOff),
        }
    }
}

impl FromStr for Run {
    type Err = UnknownRun;
    fn from_str(s: &str) -> Result<Run, UnknownRun> {
        Run::ALL
            .into_iter()
            .find(|r| r.name().eq_ignore_ascii_case(s) || r.old_name().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownRun(s.to_string()))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossKind {
    /// The Region is gone: it admits nothing, writes and reads nothing.
    Lost,
    /// The Region keeps enforcing its share, but no record crosses to or from it.
    CutOff,
}

#[derive(Clone, Copy, Debug)]
pub struct Loss {
    pub region: usize,
    /// In steps from 14:00:00.
    pub at: i64,
    pub kind: LossKind,
    /// When the outside health check starts reporting the Region down, if ever.
    pub unhealthy_from: Option<i64>,
}

/// Everything a run is made of; times are 10 ms steps from 14:00:00.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub run: &'static str,
    pub design: Design,
    pub rule: ReclaimRule,
    /// Where in each 5 s each Region rebalances.
    pub offsets: [i64; 3],
    pub seconds: i64,
    /// Demands and shares before 14:00, held long enough to be steady.
    pub demand: [f64; 3],
    pub share: [f64; 3],
    /// (step, Region, new demand).
    pub changes: Vec<(i64, usize, f64)>,
    pub loss: Option<Loss>,
    /// A fixed split of a reclaimed share instead of the Regions each side still hears from.
    pub split_silent_by: Option<u32>,
}

/// One whole second of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Second {
    pub t: String,
    /// Each Region's share; a lost Region's is the one it last held.
    pub shares: BTreeMap<&'static str, f64>,
    pub pools: BTreeMap<&'static str, f64>,
    /// Granted to each Region and not yet taken by it.
    pub grants_in_flight: BTreeMap<&'static str, f64>,
    /// The shares of the Regions that are up and enforcing them.
    pub sum_of_shares: f64,
    /// Admitted from this second to the next.
    pub admitted: f64,
}

/// A run's outcome.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub run: &'static str,
    pub design: Design,
    pub reclaim: ReclaimRule,
    pub limit: f64,
    pub burst: f64,
    pub seconds: Vec<Second>,
    pub max_sum: f64,
    pub max_sum_at: String,
    pub min_sum: f64,
    pub min_sum_at: String,
    /// The most that admissions in any interval passed limit × its length.
    pub max_excess_over_contract: f64,
    /// The first instant at which some interval admitted more than burst + limit × t.
    pub contract_broken_at: Option<String>,
    /// Where that interval starts.
    pub contract_measured_from: Option<String>,
    /// The largest gap, over every step, between L and shares + pools + grants not yet taken
    /// (less what was reclaimed from lost Regions).
    pub ledger_max_error: f64,
    /// Whether the design promises that ledger: not when shares jump, nor when a cut-off
    /// Region's room is reclaimed on both sides of the cut.
    pub ledger_promised: bool,
    #[serde(skip)]
    pub steps: Vec<Step>,
}

/// The state after each step's rebalances, for the tests.
#[derive(Clone, Copy, Debug)]
pub struct Step {
    pub sum_of_shares: f64,
    pub shares: [f64; 3],
    pub ledger_error: f64,
}

/// "14:MM:SS" for a whole second, "14:MM:SS.ss" otherwise.
pub fn clock(step: i64) -> String {
    let cs = 14 * 3600 * HZ + step;
    let (h, m, s, c) = (cs / (3600 * HZ), cs / (60 * HZ) % 60, cs / HZ % 60, cs % HZ);
    if c == 0 {
        format!("{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}:{s:02}.{c:02}")
    }
}

struct World<'a> {
    sc: &'a Scenario,
    agents: Vec<Agent>,
    /// Every record each Region wrote, with the step it was written at.
    written: Vec<Vec<(i64, ShareRecord)>>,
    /// Each Region's demand for the last 5 s, one entry a step.
    history: Vec<Vec<f64>>,
    tokens: [f64; 3],
    demand: [f64; 3],
}

impl World<'_> {
    fn new(sc: &Scenario) -> World<'_> {
        let agents: Vec<Agent> = (0..3).map(|i| Agent::new(REGIONS[i], sc.share[i])).collect();
        World {
            sc,
            written: (0..3)
                .map(|i| vec![(-10 * HZ, agents[i].record(sc.demand[i]))])
                .collect(),
            agents,
            history: (0..3).map(|i| vec![sc.demand[i]; INTERVAL as usize]).collect(),
            // A Region under its share has a full bucket; one over it has spent everything.
            tokens: std::array::from_fn(|i| {
                if sc.demand[i] < sc.share[i] {
                    2.0 * sc.share[i]
                } else {
                    0.0
                }
            }),
            demand: sc.demand,
        }
    }

    /// The scenario's changes of demand that fall on this step.
    fn change_demand(&mut self, step: i64) {
        for &(at, i, d) in &self.sc.changes {
            if at == step {
                self.demand[i] = d;
            }
        }
    }

    /// Each Region up whose rebalance falls on this step decides from what it sees, and writes
    /// its record.
    fn rebalance(&mut self, step: i64, params: &Params) {
        for i in 0..3 {
            if self.lost(i, step) || (step - self.sc.offsets[i]).rem_euclid(INTERVAL) != 0 {
                continue;
            }
            let own_demand = self.history[i].iter().sum::<f64>() / INTERVAL as f64;
            let records = self.visible(i, step);
            let unhealthy = self.unhealthy(step);
            let view = View {
                own_demand,
                records: &records,
                unhealthy: &unhealthy,
            };
            let rec = self.agents[i].rebalance(params, self.sc.design, self.sc.rule, view);
            self.written[i].push((step, rec));
        }
    }

    /// Each Region up admits this step's demand from its bucket; returns the total admitted.
    fn admit(&mut self, step: i64) -> f64 {
        let mut admitted = 0.0;
        for i in 0..3 {
            self.history[i][step.rem_euclid(INTERVAL) as usize] = self.demand[i];
            if self.lost(i, step) {
                continue;
            }
            // The bucket holds two seconds of its share; a lowered share clamps the tokens.
            // Refill and spend within the step before clamping, so a full bucket's refill
            // during the step is not lost to the clamp.
            let share = self.agents[i].share();
            let available = self.tokens[i] + share * STEP_S;
            let take = (self.demand[i] * STEP_S).min(available);
            self.tokens[i] = (available - take).min(2.0 * share);
            admitted += take;
        }
        admitted
    }

    /// The report's row for the second starting at `step`, its admissions still to add.
    fn second(&self, step: i64, sum_of_shares: f64) -> Second {
        let per = |f: &dyn Fn(usize) -> f64| (0..3).map(|i| (REGIONS[i], f(i))).collect();
        Second {
            t: clock(step),
            shares: per(&|i| self.agents[i].share()),
            pools: per(&|i| self.agents[i].pool()),
            grants_in_flight: per(&|i| self.in_flight_to(i)),
            sum_of_shares,
            admitted: 0.0,
        }
    }

    fn lost(&self, i: usize, step: i64) -> bool {
        self.sc
            .loss
            .is_some_and(|l| l.region == i && l.kind == LossKind::Lost && step >= l.at)
    }

    fn crosses(&self, writer: usize, reader: usize, written: i64) -> bool {
        self.sc
            .loss
            .is_none_or(|l| !((writer == l.region || reader == l.region) && written >= l.at))
    }

    fn visible(&self, reader: usize, step: i64) -> Vec<ShareRecord> {
        (0..3)
            .filter(|&w| w != reader)
            .filter_map(|w| {
                self.written[w]
                    .iter()
                    .rev()
                    .find(|(at, _)| at + DELAY <= step && self.crosses(w, reader, *at))
                    .map(|(_, r)| r.clone())
            })
            .collect()
    }

    fn unhealthy(&self, step: i64) -> Vec<String> {
        self.sc
            .loss
            .filter(|l| l.unhealthy_from.is_some_and(|u| step >= u))
            .map(|l| vec![REGIONS[l.region].to_string()])
            .unwrap_or_default()
    }

    fn in_flight_to(&self, to: usize) -> f64 {
        (0..3)
            .filter(|&from| from != to)
            .map(|from| self.agents[from].granted_to(REGIONS[to]) - self.agents[to].taken_from(REGIONS[from]))
            .sum()
    }

    /// How far shares + pools + grants in flight are from L. Room reclaimed from a lost Region
    /// sits in a survivor's pool while the lost Region's last share still shows, so it leaves
    /// that share; room reclaimed from a Region that is only cut off is counted twice, which is
    /// exactly the failure of reclaiming on silence.
    fn ledger_error(&self, step: i64) -> f64 {
        let held: f64 = self.agents.iter().map(|a| a.share() + a.pool()).sum();
        let flying: f64 = (0..3).map(|i| self.in_flight_to(i)).sum();
        let reclaimed: f64 = (0..3)
            .filter(|&lost| self.lost(lost, step))
            .map(|lost| {
                self.agents
                    .iter()
                    .map(|a| a.reclaimed_from(REGIONS[lost]))
                    .sum::<f64>()
            })
            .sum();
        (held + flying - reclaimed - LIMIT).abs()
    }

    fn sum_of_shares(&self, step: i64) -> f64 {
        (0..3)
            .filter(|&i| !self.lost(i, step))
            .map(|i| self.agents[i].share())
            .sum()
    }
}

/// Runs a scenario to its end.
pub fn simulate(sc: &Scenario) -> Report {
    let params = Params {
        split_silent_by: sc.split_silent_by,
        ..Params::for_limit(LIMIT)
    };
    let ledger_promised = sc.design == Design::NamedGrants
        && !(sc.rule == ReclaimRule::Silence && sc.loss.is_some_and(|l| l.kind == LossKind::CutOff));
    let mut w = World::new(sc);
    let end = sc.seconds * HZ;
    let mut steps = Vec::with_capacity(end as usize);
    let mut seconds: Vec<Second> = Vec::new();
    let mut admitted_steps = Vec::with_capacity(end as usize);
    let (mut max_sum, mut min_sum) = ((f64::MIN, 0), (f64::MAX, 0));
    for step in 0..end {
        w.change_demand(step);
        w.rebalance(step, &params);
        let ledger_error = w.ledger_error(step);
        if ledger_promised {
            assert!(
                ledger_error < EPS,
                "{}: shares + pools + grants in flight miss L by {ledger_error} at {}",
                sc.run,
                clock(step)
            );
        }
        let sum = w.sum_of_shares(step);
        if sum > max_sum.0 + EPS {
            max_sum = (sum, step);
        }
        if sum < min_sum.0 - EPS {
            min_sum = (sum, step);
        }
        steps.push(Step {
            sum_of_shares: sum,
            shares: std::array::from_fn(|i| w.agents[i].share()),
            ledger_error,
        });
        if step % HZ == 0 {
            seconds.push(w.second(step, sum));
        }
        let admitted = w.admit(step);
        admitted_steps.push(admitted);
        seconds.last_mut().expect("a second was sampled").admitted += admitted;
    }
    let contract = contract(&admitted_steps);
    Report {
        run: sc.run,
        design: sc.design,
        reclaim: sc.rule,
        limit: LIMIT,
        burst: BURST,
        seconds,
        max_sum: max_sum.0,
        max_sum_at: clock(max_sum.1),
        min_sum: min_sum.0,
        min_sum_at: clock(min_sum.1),
        max_excess_over_contract: contract.max_excess,
        contract_broken_at: contract.broken.map(|(_, at)| clock(at)),
        contract_measured_from: contract.broken.map(|(from, _)| clock(from)),
        ledger_max_error: steps.iter().map(|s| s.ledger_error).fold(0.0, f64::max),
        ledger_promised,
        steps,
    }
}

struct Contract {
    max_excess: f64,
    /// (interval start, first step end at which it held more than burst + L × t).
    broken: Option<(i64, i64)>,
}

/// Admissions against L × t over every interval of whole steps: the largest excess is the
/// running total minus L × t, less its lowest earlier value.
fn contract(admitted: &[f64]) -> Contract {
    let mut total = 0.0;
    // The lowest earlier value and where: the latest of equal lows, so an interval starts where
    // the excess began to build.
    let (mut low, mut low_at) = (0.0_f64, 0_i64);
    let mut max_excess = 0.0_f64;
    let mut broken = None;
    for (k, a) in admitted.iter().enumerate() {
        let k = k as i64;
        let here = total - LIMIT * STEP_S * k as f64;
        if here < low - EPS {
            (low, low_at) = (here, k);
        } else if here <= low + EPS {
            low_at = k;
        }
        total += a;
        let excess = total - LIMIT * STEP_S * (k + 1) as f64 - low;
        max_excess = max_excess.max(excess);
        if broken.is_none() && excess > BURST + EPS {
            broken = Some((low_at, k + 1));
        }
    }
    Contract { max_excess, broken }
}

impl Report {
    pub fn json(&self) -> String {
        let mut v = serde_json::to_value(self).expect("a report is plain data");
        round(&mut v);
        serde_json::to_string_pretty(&v).expect("a value prints")
    }

    pub fn table(&self) -> String {
        let mut out = format!(
            "run {} ({:?}, reclaim {:?}), L = {}, burst {}\n",
            self.run, self.design, self.reclaim, self.limit, self.burst
        );
        out.push_str("time          share A  share B  share C   pools  in flight  sum shares  admitted\n");
        for s in &self.seconds {
            let _ = writeln!(
                out,
                "{:<12} {:>8.0} {:>8.0} {:>8.0} {:>7.0} {:>10.0} {:>11.0} {:>9.0}",
                s.t,
                s.shares["A"],
                s.shares["B"],
                s.shares["C"],
                s.pools.values().sum::<f64>(),
                s.grants_in_flight.values().sum::<f64>(),
                s.sum_of_shares,
                s.admitted
            );
        }
        let _ = writeln!(
            out,
            "max sum of shares {:.0} at {}",
            self.max_sum, self.max_sum_at
        );
        let _ = writeln!(
            out,
            "min sum of shares {:.0} at {}",
            self.min_sum, self.min_sum_at
        );
        let _ = writeln!(
            out,
            "max excess over {} x t: {:.0}",
            self.limit, self.max_excess_over_contract
        );
        match (&self.contract_broken_at, &self.contract_measured_from) {
            (Some(at), Some(from)) => {
                let _ = writeln!(out, "contract broken at {at}, measured from {from}");
            }
            _ => out.push_str("contract held\n"),
        }
        let _ = writeln!(
            out,
            "ledger (shares + pools + grants in flight = L): {}",
            if self.ledger_max_error < EPS {
                "held at every step".to_string()
            } else {
                format!(
                    "off by up to {:.0} (not promised by this design)",
                    self.ledger_max_error
                )
            }
        );
        out
    }
}

/// Two decimals are finer than anything the model claims.
fn round(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or(0.0);
            if let Some(r) = serde_json::Number::from_f64((x * 100.0).round() / 100.0) {
                *n = r;
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(round),
        serde_json::Value::Object(o) => o.values_mut().for_each(round),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(r: Run) -> Report {
        simulate(&r.scenario())
    }

    fn second<'a>(rep: &'a Report, t: &str) -> &'a Second {
        rep.seconds.iter().find(|s| s.t == t).expect("a sampled second")
    }

    fn close(x: f64, want: f64) -> bool {
        (x - want).abs() < 0.5
    }

    /// Every combination of the three rebalance instants, for each Region.
    fn offsets() -> Vec<[i64; 3]> {
        let at = [0, 170, 330];
        let mut all = Vec::new();
        for a in at {
            for b in at {
                for c in at {
                    all.push([a, b, c]);
                }
            }
        }
        all
    }

    #[test]
    fn jumping_to_each_target_passes_the_limit_by_1898() {
        let rep = run(Run::DemandShiftJump);
        assert!(close(rep.max_sum, 11_898.0), "{}", rep.max_sum);
        assert_eq!(rep.max_sum_at, "14:00:03.30");
        assert!(
            close(rep.max_excess_over_contract, 8_480.0),
            "{}",
            rep.max_excess_over_contract
        );
        assert!(!rep.ledger_promised);
        // The busiest second: C's banked 2 x 1,350 on top of the shares.
        assert!(close(second(&rep, "14:00:00").admitted, 12_700.0));
    }

    #[test]
    fn jumping_at_the_same_instants_holds_12550_for_five_seconds() {
        let rep = simulate(&Scenario {
            offsets: [0, 0, 0],
            ..Run::DemandShiftJump.scenario()
        });
        assert!(close(rep.max_sum, 12_550.0), "{}", rep.max_sum);
        let above = rep.steps.iter().filter(|s| s.sum_of_shares > 12_549.5).count();
        assert_eq!(above, 5 * HZ as usize);
        assert!(
            close(rep.max_excess_over_contract, 15_450.0),
            "{}",
            rep.max_excess_over_contract
        );
    }

    #[test]
    fn named_grants_dip_to_8102_and_are_back_at_the_limit_from_second_19() {
        let rep = run(Run::DemandShift);
        assert!(close(rep.max_sum, 10_000.0));
        assert!(close(rep.min_sum, 8_102.0), "{}", rep.min_sum);
        assert_eq!(rep.min_sum_at, "14:00:06.70");
        // It stays there until C rebalances at 14:00:08.3.
        let dip = rep
            .steps
            .iter()
            .filter(|s| close(s.sum_of_shares, 8_102.0))
            .count();
        assert_eq!(dip, 160);
        assert!(close(second(&rep, "14:00:18").sum_of_shares, 9_450.0));
        assert!(rep.seconds[19..].iter().all(|s| close(s.sum_of_shares, 10_000.0)));
        assert!(
            close(rep.max_excess_over_contract, 2_700.0),
            "{}",
            rep.max_excess_over_contract
        );
        assert!(close(second(&rep, "14:00:00").admitted, 12_700.0));
        assert_eq!(rep.contract_broken_at, None);
    }

    #[test]
    fn named_grants_at_the_same_instants_dip_to_7450_and_settle_in_25_seconds() {
        let rep = simulate(&Scenario {
            offsets: [0, 0, 0],
            ..Run::DemandShift.scenario()
        });
        assert!(close(rep.min_sum, 7_450.0), "{}", rep.min_sum);
        let settled = rep
            .steps
            .iter()
            .rposition(|s| !close(s.sum_of_shares, 10_000.0))
            .unwrap()
            + 1;
        assert_eq!(clock(settled as i64), "14:00:25");
    }

    #[test]
    fn two_regions_raising_at_once_dip_to_5554_and_reach_their_targets_in_30_seconds() {
        let rep = run(Run::AllAtOnce);
        assert!(close(rep.min_sum, 5_554.0), "{}", rep.min_sum);
        assert!(rep.max_sum <= LIMIT + EPS);
        let targets = [
            500.0 + 8_500.0 * 1_200.0 / 15_600.0,
            500.0 + 8_500.0 * 7_200.0 / 15_600.0,
            500.0 + 8_500.0 * 7_200.0 / 15_600.0,
        ];
        let at_30 = rep.steps[30 * HZ as usize].shares;
        for (share, target) in at_30.iter().zip(targets) {
            assert!((share - target).abs() <= 0.01 * target, "{share} vs {target}");
        }
    }

    #[test]
    fn with_named_grants_no_combination_of_rebalance_instants_passes_the_limit() {
        for base in [Run::DemandShift, Run::AllAtOnce] {
            for offsets in offsets() {
                let rep = simulate(&Scenario {
                    offsets,
                    ..base.scenario()
                });
                assert!(rep.ledger_promised);
                for (k, s) in rep.steps.iter().enumerate() {
                    assert!(
                        s.sum_of_shares <= LIMIT + EPS,
                        "{} {offsets:?}: {} at {}",
                        rep.run,
                        s.sum_of_shares,
                        clock(k as i64)
                    );
                    assert!(
                        s.ledger_error < EPS,
                        "{} {offsets:?} at {}",
                        rep.run,
                        clock(k as i64)
                    );
                }
            }
        }
    }

    #[test]
    fn jumping_passes_the_limit_for_every_combination_of_instants() {
        for offsets in offsets() {
            let rep = simulate(&Scenario {
                offsets,
                ..Run::DemandShiftJump.scenario()
            });
            assert!(rep.max_sum > LIMIT + 1.0, "{offsets:?}: {}", rep.max_sum);
        }
    }

    #[test]
    fn the_ledger_holds_at_every_step_wherever_it_is_promised() {
        for r in Run::ALL {
            let rep = run(r);
            assert_eq!(rep.steps.len(), rep.seconds.len() * HZ as usize);
            let promised = !matches!(r, Run::DemandShiftJump | Run::CutOffSilence);
            assert_eq!(rep.ledger_promised, promised, "{}", rep.run);
            if promised {
                assert!(
                    rep.ledger_max_error < EPS,
                    "{}: {}",
                    rep.run,
                    rep.ledger_max_error
                );
            } else {
                assert!(
                    rep.ledger_max_error > 1_000.0,
                    "{}: {}",
                    rep.run,
                    rep.ledger_max_error
                );
            }
        }
    }

    #[test]
    fn freezing_a_lost_region_leaves_7800() {
        let rep = run(Run::LostRegionFreeze);
        let after: Vec<&Second> = rep.seconds[300..].iter().collect();
        assert!(after.iter().all(|s| s.admitted <= 7_800.0 + 0.5));
        assert!(close(second(&rep, "14:05:30").admitted, 7_800.0));
        assert!(close(second(&rep, "14:06:30").admitted, 7_800.0));
        // C's grant on its way to A.
        assert!(close(second(&rep, "14:06:09").sum_of_shares, 7_233.3));
        assert!(close(rep.min_sum, 7_233.3));
        assert_eq!(rep.min_sum_at, "14:06:08.30");
        assert_eq!(rep.contract_broken_at, None);
    }

    #[test]
    fn two_signals_bring_a_lost_regions_share_back_from_14_05_39() {
        let rep = run(Run::LostRegionTwoSignals);
        assert!(close(second(&rep, "14:05:29").admitted, 7_800.0));
        assert!(close(second(&rep, "14:05:30").admitted, 8_800.0));
        assert!(second(&rep, "14:05:38").admitted < 9_999.0);
        for t in 39..60 {
            assert!(
                close(second(&rep, &format!("14:05:{t}")).admitted, 10_000.0),
                "14:05:{t}"
            );
        }
        // B's clients arrive in A; C's 900 reaches A 1.7 s after C lowers.
        assert!(close(second(&rep, "14:06:09").sum_of_shares, 9_100.0));
        assert!(rep.seconds[370..].iter().all(|s| close(s.admitted, 10_000.0)));
        let last = rep.seconds.last().unwrap();
        assert!(close(last.shares["A"], 5_900.0) && close(last.shares["C"], 4_100.0));
        assert_eq!(rep.contract_broken_at, None);
    }

    #[test]
    fn reclaiming_on_silence_alone_admits_13600_and_breaks_the_contract_at_14_05_19_58() {
        let rep = run(Run::CutOffSilence);
        assert!(close(second(&rep, "14:05:19").admitted, 13_500.0));
        assert!(rep.seconds[320..].iter().all(|s| close(s.admitted, 13_600.0)));
        assert!(close(rep.max_sum, 20_000.0));
        assert!(close(second(&rep, "14:06:00").sum_of_shares, 20_000.0));
        assert_eq!(rep.contract_measured_from.as_deref(), Some("14:05:11.70"));
        assert_eq!(rep.contract_broken_at.as_deref(), Some("14:05:19.58"));
    }

    #[test]
    fn halving_every_silent_share_instead_peaks_at_16100_with_the_same_break() {
        let rep = simulate(&Scenario {
            split_silent_by: Some(2),
            ..Run::CutOffSilence.scenario()
        });
        assert!(close(rep.max_sum, 16_100.0), "{}", rep.max_sum);
        assert!(rep.seconds[320..].iter().all(|s| close(s.admitted, 13_600.0)));
        assert_eq!(rep.contract_broken_at.as_deref(), Some("14:05:19.58"));
    }

    #[test]
    fn a_cut_off_region_keeps_its_share_under_two_signals() {
        let rep = run(Run::CutOffTwoSignals);
        assert!(rep.seconds[19..].iter().all(|s| close(s.admitted, 10_000.0)));
        assert!(rep.max_sum <= LIMIT + EPS);
        assert_eq!(rep.contract_broken_at, None);
    }

    #[test]
    fn run_names_parse_and_unknown_ones_are_refused() {
        for r in Run::ALL {
            assert_eq!(r.name().parse::<Run>().unwrap(), r);
        }
        let e = "G3".parse::<Run>().unwrap_err();
        for r in Run::ALL {
            assert!(e.to_string().contains(r.name()), "{e}");
        }
    }

    #[test]
    fn the_names_an_earlier_release_printed_still_parse() {
        // The names an earlier release printed.
        let old = [
            ("G1", "demand-shift"),
            ("G1-naive", "demand-shift-jump"),
            ("G1c", "all-at-once"),
            ("G2-freeze", "lost-region-freeze"),
            ("G2-two-signals", "lost-region-two-signals"),
            ("G2-silence", "cut-off-silence"),
            ("G2-cut-two-signals", "cut-off-two-signals"),
        ];
        for (was, is) in old {
            let run = is.parse::<Run>().unwrap();
            assert_eq!(run.name(), is);
            assert_eq!(was.parse::<Run>().unwrap(), run, "{was}");
            assert_eq!(was.to_lowercase().parse::<Run>().unwrap(), run, "{was}");
        }
    }

    #[test]
    fn json_has_the_per_second_rows_and_the_figures() {
        let v: serde_json::Value = serde_json::from_str(&run(Run::DemandShift).json()).unwrap();
        assert_eq!(v["min_sum"], 8_101.88);
        assert_eq!(v["seconds"].as_array().unwrap().len(), 40);
        assert_eq!(v["seconds"][5]["shares"]["A"], 4_334.59);
        assert_eq!(v["seconds"][5]["grants_in_flight"]["C"], 1_265.41);
        assert!(v["contract_broken_at"].is_null());
        assert!(v.get("steps").is_none());
    }
}
