//! The `edge` design: a WAF's rate-based rule in front of the gateway, modelled on what AWS WAF
//! documents for its rate-based rules. It counts each source address's requests, not each key's,
//! looks at the count only on a grid of checks, and acts only some time after a check.
//!
//! - A check at `T` counts the address's requests at `x` with `T − W < x ≤ T`, blocked ones
//!   too unless `--edge-count-blocked false`.
//! - Checks fall on multiples of `--edge-check` from time 0 (midnight, for clock times).
//! - The first check whose count is over the limit (`count > N`) schedules a block from
//!   `--edge-delay` later. While a block is scheduled or on, the first check whose count is not
//!   over the limit schedules its lift `--edge-delay` later; a check over the limit before that
//!   lift cancels it, and the next check not over the limit schedules it again.
//! - A request is blocked when `start ≤ t < end`.
//!
//! A check counts the requests of its own instant, so it can only run once that instant's last
//! row is in: checks run per address when a later row of the address arrives, or when the replay
//! is summed up, and the delay must be above zero so no check acts on its own instant.
//!
//! How late the rule is shows against the flood's start: the first whole second (aligned on
//! seconds from time 0, and not before the address's previous block lifted) whose arrivals from
//! the address exceed the rule's average rate N/W, among the seconds the first over-limit check
//! counted (those starting at or after `T − W`), or failing those the first before the block
//! starts; and the requests from the address that passed from then until the block started.

use std::collections::{HashMap, VecDeque};

use tollgate_limit::bucket::{Rate, US_PER_S};

use super::algorithms::Verdict;

/// The rule and how the WAF applies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EdgeConfig {
    /// N requests per trailing window W, from one address.
    pub rule: Rate,
    /// The grid of checks, µs.
    pub check_us: u64,
    /// From a check to its block or lift, µs.
    pub delay_us: u64,
    /// Whether blocked requests count toward the rate (AWS WAF counts them).
    pub count_blocked: bool,
}

impl EdgeConfig {
    /// The rule in words, as the summary's `limit`.
    pub fn describe(&self) -> String {
        format!(
            "edge rule {} per address, checked every {}, acting {} later, blocked requests {}",
            self.rule,
            span(self.check_us),
            span(self.delay_us),
            if self.count_blocked {
                "counted"
            } else {
                "not counted"
            }
        )
    }
}

/// `10s`, `250ms` or `1500us`.
pub(crate) fn span(us: u64) -> String {
    if us.is_multiple_of(US_PER_S) {
        format!("{}s", us / US_PER_S)
    } else if us.is_multiple_of(1_000) {
        format!("{}ms", us / 1_000)
    } else {
        format!("{us}us")
    }
}

/// One block, from the check that scheduled it to its lift.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Index of the address in [`EdgeRule::address`].
    pub addr: u32,
    pub first_over_check: u64,
    pub start: u64,
    /// The check that scheduled the lift (the first not over the limit since the last one over
    /// it); `None` while the address is still over the limit.
    pub first_under_check: Option<u64>,
    pub end: Option<u64>,
    pub flood_start: Option<u64>,
    /// The address's passed requests before the flood's second.
    passed_before_flood: u64,
    /// Requests from the address that passed from the flood's start until the block started.
    pub passed: Option<u64>,
    pub blocked: u64,
}

/// One source address's count and state.
#[derive(Clone, Debug)]
struct Addr {
    name: Box<str>,
    /// Counted arrivals as (time, running count), oldest first, one entry per distinct time.
    window: VecDeque<(u64, u64)>,
    counted: u64,
    /// The running count at the newest entry that has left the window.
    left: u64,
    /// The first check not yet run.
    next_check: u64,
    /// The block scheduled or on.
    block: Option<u32>,
    /// The scheduled lift: when, and the check that scheduled it.
    lift: Option<(u64, u64)>,
    /// Requests from the address that passed, ever.
    passed: u64,
    /// The whole second being counted for floods (index from time 0), its arrivals, and the
    /// passed count when it began.
    second: u64,
    second_arrivals: u64,
    passed_before_second: u64,
    second_flooded: bool,
    /// Flooding seconds (start, passed before it) recent enough to start a flood.
    floods: VecDeque<(u64, u64)>,
    /// Seconds starting before this never start a flood: the previous block lifted then.
    floods_from: u64,
}

/// The rule over every address of a trace.
#[derive(Clone, Debug)]
pub struct EdgeRule {
    cfg: EdgeConfig,
    ids: HashMap<Box<str>, u32>,
    addrs: Vec<Addr>,
    blocks: Vec<Block>,
}

impl EdgeRule {
    pub fn new(cfg: EdgeConfig) -> EdgeRule {
        EdgeRule {
            cfg,
            ids: HashMap::new(),
            addrs: Vec::new(),
            blocks: Vec::new(),
        }
    }

    pub fn config(&self) -> &EdgeConfig {
        &self.cfg
    }

    /// The first check at or after `t`.
    fn check_at_or_after(&self, t: u64) -> u64 {
        t.div_ceil(self.cfg.check_us).saturating_mul(self.cfg.check_us)
    }

    /// Decides one request from `ip` at `now`; rows come in time order.
    pub fn check(&mut self, ip: &str, now: u64) -> Verdict {
        let a = match self.ids.get(ip) {
            Some(&a) => a as usize,
            None => {
                self.addrs.push(Addr {
                    name: ip.into(),
                    window: VecDeque::new(),
                    counted: 0,
                    left: 0,
                    next_check: self.check_at_or_after(now),
                    block: None,
                    lift: None,
                    passed: 0,
                    second: u64::MAX,
                    second_arrivals: 0,
                    passed_before_second: 0,
                    second_flooded: false,
                    floods: VecDeque::new(),
                    floods_from: 0,
                });
                self.ids.insert(ip.into(), (self.addrs.len() - 1) as u32);
                self.addrs.len() - 1
            }
        };
        self.advance(a, now, now);
        let blocked_by = self.addrs[a]
            .block
            .filter(|&b| self.blocks[b as usize].start <= now);
        if let Some(b) = blocked_by {
            self.blocks[b as usize].blocked += 1;
        }
        let addr = &mut self.addrs[a];
        if self.cfg.count_blocked || blocked_by.is_none() {
            addr.counted += 1;
            match addr.window.back_mut() {
                Some(last) if last.0 == now => last.1 = addr.counted,
                _ => addr.window.push_back((now, addr.counted)),
            }
        }
        let second = now / US_PER_S;
        if second != addr.second {
            addr.second = second;
            addr.second_arrivals = 0;
            addr.passed_before_second = addr.passed;
            addr.second_flooded = false;
        }
        addr.second_arrivals += 1;
        if let Some(b) = blocked_by {
            return Verdict {
                block: Some(b),
                ..Verdict::refuse(None)
            };
        }
        addr.passed += 1;
        let start = second * US_PER_S;
        let rule = self.cfg.rule;
        // Over N/W a second: arrivals · W > N · 1 s.
        if !addr.second_flooded
            && start >= addr.floods_from
            && addr.second_arrivals as u128 * rule.period_us as u128 > rule.tokens as u128 * US_PER_S as u128
        {
            addr.second_flooded = true;
            match addr.block {
                None => addr.floods.push_back((start, addr.passed_before_second)),
                // Scheduled, with no flood among the seconds its check counted.
                Some(b) => {
                    let block = &mut self.blocks[b as usize];
                    if block.flood_start.is_none() {
                        block.flood_start = Some(start);
                        block.passed_before_flood = addr.passed_before_second;
                    }
                }
            }
        }
        Verdict::ALLOW
    }

    /// Runs the address's checks before `checks_before` and its lifts up to `lifts_by`, in
    /// time order: a lift at the instant of a check comes first.
    fn advance(&mut self, a: usize, checks_before: u64, lifts_by: u64) {
        loop {
            let addr = &self.addrs[a];
            let t = addr.next_check;
            if let Some((at, _)) = addr.lift
                && at <= lifts_by
                && (at <= t || t >= checks_before)
            {
                self.lift(a);
                continue;
            }
            if t >= checks_before {
                return;
            }
            let quiet = self.run_check(a, t);
            let next = t.saturating_add(self.cfg.check_us);
            // Counts only fall until the next arrival: once a check changes nothing but a
            // pending lift, the checks up to that arrival change nothing either.
            self.addrs[a].next_check = if quiet {
                next.max(self.check_at_or_after(checks_before))
            } else {
                next
            };
        }
    }

    /// The check at `t`; true when the count is not over the limit and no block waits for a
    /// lift to be scheduled.
    fn run_check(&mut self, a: usize, t: u64) -> bool {
        let (w, n, delay) = (self.cfg.rule.period_us, self.cfg.rule.tokens, self.cfg.delay_us);
        let addr = &mut self.addrs[a];
        while let Some(&(x, cum)) = addr.window.front() {
            if x.saturating_add(w) <= t {
                addr.left = cum;
                addr.window.pop_front();
            } else {
                break;
            }
        }
        let over = addr.counted - addr.left > n;
        match addr.block {
            None => {
                while addr.floods.front().is_some_and(|&(s, _)| s.saturating_add(w) < t) {
                    addr.floods.pop_front();
                }
                if over {
                    let (flood_start, passed_before_flood) = match addr.floods.front() {
                        Some(&(s, p)) => (Some(s), p),
                        None => (None, 0),
                    };
                    addr.floods.clear();
                    addr.block = Some(self.blocks.len() as u32);
                    self.blocks.push(Block {
                        addr: a as u32,
                        first_over_check: t,
                        start: t.saturating_add(delay),
                        first_under_check: None,
                        end: None,
                        flood_start,
                        passed_before_flood,
                        passed: None,
                        blocked: 0,
                    });
                }
            }
            Some(_) => match addr.lift {
                None if !over => addr.lift = Some((t.saturating_add(delay), t)),
                Some(_) if over => addr.lift = None,
                _ => {}
            },
        }
        !over && (addr.block.is_none() || addr.lift.is_some())
    }

    /// The address's block ends at its scheduled lift.
    fn lift(&mut self, a: usize) {
        let addr = &mut self.addrs[a];
        let (Some(b), Some((at, under))) = (addr.block.take(), addr.lift.take()) else {
            return;
        };
        addr.floods.clear();
        addr.floods_from = at;
        let passed = addr.passed;
        let block = &mut self.blocks[b as usize];
        block.end = Some(at);
        block.first_under_check = Some(under);
        block.passed = block.flood_start.map(|_| passed - block.passed_before_flood);
    }

    /// Block `b`'s end, once it is certain: at a row's time `now` (every row up to it is in),
    /// when it has lifted by then; with `None` once the trace is over (its last row at `last`),
    /// when a lift is scheduled, since no later arrival can cancel it.
    pub fn block_end(&mut self, b: u32, now: Option<u64>, last: u64) -> Option<u64> {
        let a = self.blocks.get(b as usize)?.addr as usize;
        match now {
            Some(t) => self.advance(a, t, t),
            None => self.advance(a, last.saturating_add(1), last),
        }
        let block = &self.blocks[b as usize];
        match (block.end, now) {
            (Some(end), _) => Some(end),
            (None, None) if self.addrs[a].block == Some(b) => self.addrs[a].lift.map(|l| l.0),
            _ => None,
        }
    }

    /// Every block as the trace leaves it (its last row at `last`): checks up to that instant
    /// run, and a block still on shows its scheduled lift, if any.
    pub fn blocks_at_end(&self, last: u64) -> Vec<Block> {
        let mut end = self.clone();
        for a in 0..end.addrs.len() {
            end.advance(a, last.saturating_add(1), last);
            let addr = &end.addrs[a];
            if let Some(b) = addr.block {
                let block = &mut end.blocks[b as usize];
                if let Some((at, under)) = addr.lift {
                    block.end = Some(at);
                    block.first_under_check = Some(under);
                }
                block.passed = block.flood_start.map(|_| addr.passed - block.passed_before_flood);
            }
        }
        end.blocks
    }

    /// An address by its index in [`Block::addr`].
    pub fn address(&self, a: u32) -> &str {
        &self.addrs[a as usize].name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = US_PER_S;
    const IP: &str = "192.0.2.1";

    /// 10 per 10 s, checked every 10 s.
    fn rule(delay_s: u64, count_blocked: bool) -> EdgeRule {
        EdgeRule::new(EdgeConfig {
            rule: Rate::parse("10/10s").unwrap(),
            check_us: 10 * S,
            delay_us: delay_s * S,
            count_blocked,
        })
    }

    /// `n` arrivals `step` µs apart from `from` µs; how many were blocked.
    fn send(r: &mut EdgeRule, from: u64, step: u64, n: u64) -> u64 {
        (0..n).filter(|i| !r.check(IP, from + i * step).admitted).count() as u64
    }

    #[test]
    fn blocks_from_a_delay_after_the_first_check_over_the_limit_until_one_after_the_first_under() {
        let mut r = rule(5, true);
        // One a second, never a flooding second (over 1 a second), and 11 in (0, 10 s]: the
        // check at 10 s blocks from 15 s.
        assert_eq!(send(&mut r, S / 2, S, 10), 0);
        assert!(r.check(IP, 10 * S).admitted);
        // Four a second from 12 s: the flood starts at 12 s, and those from 15 s are blocked.
        assert_eq!(send(&mut r, 12 * S, S / 4, 20), 8);
        // The check at 20 s is over the limit, the one at 30 s is not: the lift is at 35 s.
        assert!(!r.check(IP, 35 * S - 1).admitted);
        assert!(r.check(IP, 35 * S).admitted);
        let blocks = r.blocks_at_end(35 * S);
        assert_eq!(blocks.len(), 1);
        let b = &blocks[0];
        assert_eq!(
            (b.first_over_check, b.start, b.first_under_check, b.end, b.blocked),
            (10 * S, 15 * S, Some(30 * S), Some(35 * S), 9)
        );
        // 12 passed in [12 s, 15 s).
        assert_eq!((b.flood_start, b.passed), (Some(12 * S), Some(12)));
    }

    #[test]
    fn a_check_over_the_limit_before_the_lift_cancels_it() {
        let mut r = rule(15, true);
        // Over at the 10 s check: blocked from 25 s. Nothing in (10 s, 20 s]: lift at 35 s.
        assert_eq!(send(&mut r, 0, S / 2, 20), 0);
        // Eleven at 22 s pass; the check at 30 s counts them and cancels the lift.
        assert_eq!(send(&mut r, 22 * S, 1_000, 11), 0);
        assert!(!r.check(IP, 25 * S).admitted);
        assert_eq!(r.block_end(0, Some(25 * S), 25 * S), None);
        assert!(!r.check(IP, 36 * S).admitted);
        // The check at 40 s counts one: lift at 55 s, known for sure once the trace is over.
        let b = &r.blocks_at_end(41 * S)[0];
        assert_eq!((b.first_under_check, b.end), (Some(40 * S), Some(55 * S)));
        assert_eq!(r.block_end(0, Some(41 * S), 41 * S), None);
        assert_eq!(r.block_end(0, None, 41 * S), Some(55 * S));
        // The first flooding second is among those the 10 s check counted.
        assert_eq!((b.flood_start, b.passed), (Some(0), Some(20 + 11)));
    }

    #[test]
    fn uncounted_blocked_requests_let_a_block_lift_and_come_back() {
        // Over at the 10 s check, blocked from 15 s; then 20 a second from 15 s to 40 s.
        let blocks = |count_blocked| {
            let mut r = rule(5, count_blocked);
            send(&mut r, 0, S / 2, 20);
            send(&mut r, 15 * S, S / 20, 500);
            r.blocks_at_end(40 * S)
                .iter()
                .map(|b| (b.start / S, b.end.map(|e| e / S)))
                .collect::<Vec<_>>()
        };
        // Counted, the blocked traffic keeps every check over the limit.
        assert_eq!(blocks(true), [(15, None)]);
        // Not counted, the 20 s check sees nothing and lifts at 25 s; what passes then puts the
        // 30 s check over again.
        assert_eq!(blocks(false), [(15, Some(25)), (35, None)]);
    }

    #[test]
    fn a_request_exactly_one_window_old_has_left_the_count() {
        for (first, blocks) in [(0, 0), (1, 1)] {
            let mut r = rule(5, true);
            // One at `first` µs and ten at 5 s: the check at 10 s counts (0, 10 s].
            send(&mut r, first, 0, 1);
            send(&mut r, 5 * S, 0, 10);
            assert_eq!(r.blocks_at_end(10 * S).len(), blocks, "first at {first} µs");
        }
    }
}
