//! What one Region's agent decides at a rebalance, from its own demand and the other Regions'
//! records it can see: its target, its share, its pool of free room, the room it grants by name
//! and when a silent Region's share may be reclaimed. Pure: no clock, no store, no I/O, so the
//! model and a live agent run the same decisions.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The numbers of one shared limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    /// The limit all Regions share, per second.
    pub limit: f64,
    /// What every live Region keeps, so an idle Region can still absorb a sudden burst.
    pub floor: f64,
    /// The most a share may rise at one rebalance.
    pub max_raise: f64,
    /// How many of this agent's own rebalances a Region's record must stay unchanged before
    /// that Region counts as silent.
    pub silent_after: u32,
    /// How many ways a reclaimed share is split. `None`: this Region and the others it still
    /// hears from, so a Region cut off alone takes the whole share. A fixed number is the
    /// what-if beside it.
    pub split_silent_by: Option<u32>,
}

impl Params {
    /// The design's choices: a floor of 5% and raises of at most 10% of the limit, silence after
    /// three unchanged records.
    pub fn for_limit(limit: f64) -> Params {
        Params {
            limit,
            floor: limit * 0.05,
            max_raise: limit * 0.10,
            silent_after: 3,
            split_silent_by: None,
        }
    }
}

/// How shares move toward their targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Design {
    /// Each Region takes its target at once. Kept only to show why it fails: two Regions that
    /// see each other's demand late can both raise into the same room.
    Jump,
    /// Lower at once; raise only from room another Region granted to this one by name.
    NamedGrants,
}

/// What to do with the share of a Region whose record stopped changing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReclaimRule {
    /// Keep counting its last share as taken, forever.
    Freeze,
    /// Reclaim once its record is silent and the outside health check reports it down: a
    /// Region that is only cut off still passes the health check and keeps its share.
    TwoSignals,
    /// Reclaim on a silent record alone; a cut-off Region then has its room spent twice.
    Silence,
}

/// What a Region publishes at each rebalance. Grants are running totals per recipient, so a
/// record read twice or late never hands out room twice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShareRecord {
    pub region: String,
    /// Rises at every rebalance; an unchanged number is what silence means.
    pub seq: u64,
    /// Requests received per second over the last interval, admitted or refused: admissions
    /// could never show that a share is too small.
    pub demand: f64,
    pub share: f64,
    /// Target minus share, what this Region still waits to be granted.
    pub unmet: f64,
    /// Room granted so far to each other Region, by name.
    pub granted: BTreeMap<String, f64>,
}

/// What an agent sees at a rebalance.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    /// Its own Region's demand over the last interval.
    pub own_demand: f64,
    /// The newest record of each other Region that has reached this Region.
    pub records: &'a [ShareRecord],
    /// The Regions the outside health check currently reports down.
    pub unhealthy: &'a [String],
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Watch {
    seq: u64,
    unchanged: u32,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Reclaimed {
    amount: f64,
    /// The record's number when it was reclaimed: a newer one means the Region is back.
    seq: u64,
}

/// One Region's agent: its share and the room it holds or has handed out. It serializes whole,
/// so a live agent that takes over from a dead one goes on from the same share, pool and
/// running grant totals.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Agent {
    name: String,
    share: f64,
    pool: f64,
    seq: u64,
    target: f64,
    granted: BTreeMap<String, f64>,
    taken: BTreeMap<String, f64>,
    watch: BTreeMap<String, Watch>,
    reclaimed: BTreeMap<String, Reclaimed>,
}

impl Agent {
    /// An agent that already holds `share` (a steady state, or a new agent taking over).
    pub fn new(name: impl Into<String>, share: f64) -> Agent {
        Agent {
            name: name.into(),
            share,
            pool: 0.0,
            seq: 0,
            target: share,
            granted: BTreeMap::new(),
            taken: BTreeMap::new(),
            watch: BTreeMap::new(),
            reclaimed: BTreeMap::new(),
        }
    }

    /// A Region coming back after the others may have reclaimed its room: it owns nothing until
    /// someone grants it room by name.
    pub fn returning(name: impl Into<String>) -> Agent {
        Agent::new(name, 0.0)
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn share(&self) -> f64 {
        self.share
    }
    pub fn pool(&self) -> f64 {
        self.pool
    }
    pub fn target(&self) -> f64 {
        self.target
    }
    /// Room granted to `to` so far.
    pub fn granted_to(&self, to: &str) -> f64 {
        self.granted.get(to).copied().unwrap_or(0.0)
    }
    /// Room taken so far from grants `from` made.
    pub fn taken_from(&self, from: &str) -> f64 {
        self.taken.get(from).copied().unwrap_or(0.0)
    }
    /// Room this agent took from silent Regions.
    pub fn reclaimed_total(&self) -> f64 {
        self.reclaimed.values().map(|r| r.amount).sum()
    }
    /// Every Region this agent reclaimed from, with the room it took.
    pub fn reclaimed(&self) -> impl Iterator<Item = (&str, f64)> {
        self.reclaimed.iter().map(|(r, c)| (r.as_str(), c.amount))
    }
    /// Room this agent took from `from`'s share after it fell silent.
    pub fn reclaimed_from(&self, from: &str) -> f64 {
        self.reclaimed.get(from).map_or(0.0, |r| r.amount)
    }

    /// The record this agent would publish now, without deciding anything.
    pub fn record(&self, demand: f64) -> ShareRecord {
        ShareRecord {
            region: self.name.clone(),
            seq: self.seq,
            demand,
            share: self.share,
            unmet: (self.target - self.share).max(0.0),
            granted: self.granted.clone(),
        }
    }

    /// One rebalance: reclaim what the rule allows, take granted room, lower or raise toward the
    /// target, grant the rest by name; returns the record to publish.
    pub fn rebalance(
        &mut self,
        p: &Params,
        design: Design,
        rule: ReclaimRule,
        view: View<'_>,
    ) -> ShareRecord {
        self.observe(view.records);
        if design == Design::NamedGrants {
            self.reclaim(p, rule, view);
        }
        self.target = self.target_share(p, view);
        match design {
            Design::Jump => self.share = self.target,
            Design::NamedGrants => {
                self.take_grants(view.records);
                if self.target < self.share {
                    self.pool += self.share - self.target;
                    self.share = self.target;
                } else {
                    let raise = (self.target - self.share).min(self.pool).min(p.max_raise);
                    self.share += raise;
                    self.pool -= raise;
                }
                self.grant(view.records);
            }
        }
        self.seq += 1;
        self.record(view.own_demand)
    }

    fn observe(&mut self, records: &[ShareRecord]) {
        for r in records.iter().filter(|r| r.region != self.name) {
            match self.watch.get_mut(&r.region) {
                Some(w) if w.seq == r.seq => w.unchanged += 1,
                Some(w) => {
                    *w = Watch {
                        seq: r.seq,
                        unchanged: 0,
                    }
                }
                None => {
                    self.watch.insert(
                        r.region.clone(),
                        Watch {
                            seq: r.seq,
                            unchanged: 0,
                        },
                    );
                }
            }
            // A fresh record from a reclaimed Region means it is back: it starts from nothing
            // and counts in the targets again.
            if self.reclaimed.get(&r.region).is_some_and(|c| c.seq != r.seq) {
                self.reclaimed.remove(&r.region);
            }
        }
    }

    fn silent(&self, p: &Params, region: &str) -> bool {
        self.watch
            .get(region)
            .is_some_and(|w| w.unchanged >= p.silent_after)
    }

    /// Other Regions this agent still hears from and has not reclaimed.
    fn heard(&self, records: &[ShareRecord]) -> usize {
        records
            .iter()
            .filter(|r| r.region != self.name && !self.reclaimed.contains_key(&r.region))
            .filter(|r| self.watch.get(&r.region).is_some_and(|w| w.unchanged == 0))
            .count()
    }

    fn reclaim(&mut self, p: &Params, rule: ReclaimRule, view: View<'_>) {
        if rule == ReclaimRule::Freeze {
            return;
        }
        for r in view.records {
            if r.region == self.name || self.reclaimed.contains_key(&r.region) || !self.silent(p, &r.region) {
                continue;
            }
            if rule == ReclaimRule::TwoSignals && !view.unhealthy.contains(&r.region) {
                continue;
            }
            // Every Region on this side of the silence applies the same fixed split, so no
            // part of the share is taken twice without anyone having to agree on it.
            let side = p
                .split_silent_by
                .map_or_else(|| 1 + self.heard(view.records), |n| n.max(1) as usize);
            let amount = r.share / side as f64;
            self.pool += amount;
            self.reclaimed
                .insert(r.region.clone(), Reclaimed { amount, seq: r.seq });
        }
    }

    /// Floor for every Region counted live, the rest by demand; a reclaimed Region no longer
    /// counts, a silent one not yet reclaimed still does with its last demand.
    fn target_share(&self, p: &Params, view: View<'_>) -> f64 {
        let others: Vec<&ShareRecord> = view
            .records
            .iter()
            .filter(|r| r.region != self.name && !self.reclaimed.contains_key(&r.region))
            .collect();
        let live = 1 + others.len();
        let total: f64 = view.own_demand + others.iter().map(|r| r.demand).sum::<f64>();
        let spare = (p.limit - live as f64 * p.floor).max(0.0);
        if total <= 0.0 {
            return p.limit / live as f64;
        }
        p.floor + spare * view.own_demand / total
    }

    fn take_grants(&mut self, records: &[ShareRecord]) {
        for r in records.iter().filter(|r| r.region != self.name) {
            let given = r.granted.get(&self.name).copied().unwrap_or(0.0);
            let taken = self.taken.entry(r.region.clone()).or_insert(0.0);
            if given > *taken {
                self.pool += given - *taken;
                *taken = given;
            }
        }
    }

    fn grant(&mut self, records: &[ShareRecord]) {
        let needs: Vec<(&str, f64)> = records
            .iter()
            .filter(|r| r.region != self.name && !self.reclaimed.contains_key(&r.region) && r.unmet > 0.0)
            .map(|r| (r.region.as_str(), r.unmet))
            .collect();
        let total: f64 = needs.iter().map(|(_, u)| u).sum();
        if total <= 0.0 || self.pool <= 0.0 {
            return;
        }
        // Never more than a Region asked for; whatever nobody asked for stays in the pool.
        let (fraction, left) = if self.pool >= total {
            (1.0, self.pool - total)
        } else {
            (self.pool / total, 0.0)
        };
        for (to, unmet) in needs {
            *self.granted.entry(to.to_string()).or_insert(0.0) += unmet * fraction;
        }
        self.pool = left;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(region: &str, seq: u64, demand: f64, share: f64, unmet: f64) -> ShareRecord {
        ShareRecord {
            region: region.into(),
            seq,
            demand,
            share,
            unmet,
            granted: BTreeMap::new(),
        }
    }

    #[test]
    fn lowering_frees_room_that_goes_only_to_a_region_that_asked() {
        let p = Params::for_limit(10_000.0);
        let mut a = Agent::new("A", 5_600.0);
        let records = [
            rec("B", 1, 3_600.0, 3_050.0, 0.0),
            rec("C", 1, 5_160.0, 1_350.0, 1_898.0),
        ];
        let r = a.rebalance(
            &p,
            Design::NamedGrants,
            ReclaimRule::TwoSignals,
            View {
                own_demand: 7_200.0,
                records: &records,
                unhealthy: &[],
            },
        );
        assert!((r.share - 4_334.59).abs() < 0.01, "{}", r.share);
        assert!((r.granted["C"] - (5_600.0 - r.share)).abs() < 1e-9);
        assert!(!r.granted.contains_key("B"));
        assert_eq!(a.pool(), 0.0);
    }

    #[test]
    fn a_raise_comes_only_from_the_pool_and_at_most_a_tenth_of_the_limit() {
        let p = Params::for_limit(10_000.0);
        let mut c = Agent::new("C", 1_350.0);
        let mut a_rec = rec("A", 2, 7_200.0, 4_335.0, 0.0);
        a_rec.granted.insert("C".into(), 1_265.0);
        let mut b_rec = rec("B", 2, 3_600.0, 2_417.0, 0.0);
        b_rec.granted.insert("C".into(), 633.0);
        let records = [a_rec, b_rec];
        let view = View {
            own_demand: 7_200.0,
            records: &records,
            unhealthy: &[],
        };
        c.rebalance(&p, Design::NamedGrants, ReclaimRule::Freeze, view);
        assert_eq!(c.share(), 2_350.0);
        assert_eq!(c.pool(), 898.0);
        // The same records again: the running totals were taken already.
        c.rebalance(&p, Design::NamedGrants, ReclaimRule::Freeze, view);
        assert_eq!(c.share() + c.pool(), 1_350.0 + 1_898.0);
    }

    #[test]
    fn a_silent_region_is_reclaimed_only_with_the_health_check_under_two_signals() {
        let p = Params::for_limit(10_000.0);
        let records = [
            rec("B", 7, 3_600.0, 2_200.0, 0.0),
            rec("C", 1, 7_200.0, 3_900.0, 0.0),
        ];
        let down = ["B".to_string()];
        for (unhealthy, expect) in [(&[][..], 0.0), (&down[..], 1_100.0)] {
            let mut a = Agent::new("A", 3_900.0);
            for c_seq in 1..=4 {
                let mut rs = records.clone();
                rs[1].seq = c_seq;
                a.rebalance(
                    &p,
                    Design::NamedGrants,
                    ReclaimRule::TwoSignals,
                    View {
                        own_demand: 7_200.0,
                        records: &rs,
                        unhealthy,
                    },
                );
            }
            assert_eq!(a.reclaimed_from("B"), expect);
        }
    }

    #[test]
    fn a_returning_region_starts_with_nothing() {
        let a = Agent::returning("B");
        assert_eq!(a.share(), 0.0);
        assert_eq!(a.pool(), 0.0);
    }
}
