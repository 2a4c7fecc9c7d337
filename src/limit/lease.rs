//! Leased blocks for hot keys: the store's grant math and the gateway's block holder, pure and
//! time-injected, so `tollgate replay`, the gateway (`store::lease`) and its Lua twin
//! (`lua/lease.lua`) share one definition.
//!
//! A key too hot for one store shard (k-big: 100,000 checks a second) is not asked
//! once per request. Each gateway leases a *block* of `B` tokens from the shared bucket, spends
//! it in memory, and asks again only when the block runs low:
//!
//! - **Store side** ([`lease`], [`give_back`]): refill the bucket from the *store's* clock
//!   exactly as a check does ([`crate::bucket::refill`]), then grant a whole block or
//!   nothing. Partial grants would bring back one store call per request. On nothing, answer
//!   `denied_until = now + N × B / r`: one block cycle, the time the bucket needs to refill a
//!   block for every gateway. A give-back adds unused tokens, capped at the burst.
//! - **Gateway side** ([`Holder`]): spend held tokens (oldest block first, as it expires
//!   first); refuse locally when they run out, with `Retry-After` from `denied_until`; ask for
//!   the next block when at most 20% of `B` is left, with at most one lease in flight per
//!   gateway and key, and never before `denied_until` plus a random 0–50 ms chosen by the
//!   caller (so twenty denied gateways don't return together). A block expires
//!   [`BLOCK_TTL_US`] after it was received, timed by the gateway's monotonic clock; its unused
//!   tokens go back to the store.
//!
//! Nothing here does I/O, reads a clock or draws a random number: `now` and the jitter are
//! arguments. The overshoot is bounded: a gateway holds at most the rest of one block below
//! 20% plus the next block, so the fleet can spend at most `N × 1.2 × B` tokens beyond what
//! one central bucket would have admitted. Leasing is for capacity limits above about 500 a
//! second (rule validation enforces it), never for security limits.
//!
//! The Lua twin must keep the same integer arithmetic: tokens in units of `1 / scale`,
//! microseconds, `denied_until` rounded up to the next microsecond.
//!
//! **A gateway that dies holding blocks** ([`HolderRecords`], [`lease_recorded`],
//! [`give_back_recorded`]): beside the bucket the store keeps one record per gateway, the
//! tokens granted to it that it has not yet reported spent or given back, and a store-clock
//! expiry [`RECORD_TTL_US`] after its last call. Every call reports the tokens the gateway
//! spent since its previous call, so a record is what the gateway held at its last call plus
//! what that call granted. A live gateway calls again before its record expires (a block's
//! expiry gives back, or a sync with nothing to give); a killed one doesn't, and the next lease
//! or give-back on the bucket after the expiry puts its record's tokens back, capped at the
//! burst. The store can't know how many of them the dead gateway had spent: each crash may
//! admit up to that record (at most 1.2 × B with requests of cost 1) once more.

use std::collections::BTreeMap;

use smallvec::SmallVec;

use super::bucket::{self, BucketParams, BucketState, US_PER_S, refill};

/// A block expires this long after the gateway received it; its unused tokens go back.
pub const BLOCK_TTL_US: u64 = 10 * US_PER_S;

/// The largest random delay a denied gateway adds to `denied_until`.
pub const MAX_JITTER_US: u64 = 50_000;

/// How long past a block's TTL the store keeps a silent gateway's record: room for the lease's
/// answer on its way (a gateway drops one older than a second), its expiry timer running late
/// and the give-back's trip, so a live gateway's own give-back always arrives first.
pub const RECORD_GRACE_US: u64 = 2 * US_PER_S;

/// A record expires this long after the gateway's last call on the store's clock: the block
/// TTL plus [`RECORD_GRACE_US`]. A killed gateway's tokens are back within it.
pub const RECORD_TTL_US: u64 = BLOCK_TTL_US + RECORD_GRACE_US;

/// The automatic block: about a quarter second of one gateway's share of the rate, and at
/// least 10 tokens: `max(10, ⌈0.25 s × r / N⌉)`. For k-big (10,000/s, 20 gateways) it is 125.
pub fn auto_block(p: &BucketParams, gateways: u64) -> u64 {
    let num = p.rate.tokens as u128 * (US_PER_S as u128 / 4);
    let den = p.rate.period_us as u128 * gateways.max(1) as u128;
    (num.div_ceil(den).min(u64::MAX as u128) as u64).max(10)
}

/// One block cycle, `N × B / r` in microseconds rounded up: how long the bucket takes to
/// refill one block for every gateway. For k-big it is 250 ms.
pub fn block_cycle_us(p: &BucketParams, block: u64, gateways: u64) -> u64 {
    let num = gateways.max(1) as u128 * block as u128 * p.rate.period_us as u128;
    num.div_ceil(p.rate.tokens as u128).min(u64::MAX as u128) as u64
}

/// Why a lease configuration can't work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("a lease block must be at least 1 token")]
    ZeroBlock,
    #[error("block {block} is above the burst {burst}: the bucket could never hold a whole block")]
    BlockAboveBurst { block: u64, burst: u64 },
}

/// What one leased limit needs, on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    /// The shared bucket's numbers.
    pub params: BucketParams,
    /// Tokens per block, `B`.
    pub block: u64,
    /// Gateways sharing the bucket, `N`.
    pub gateways: u64,
}

impl LeaseConfig {
    pub fn new(params: BucketParams, block: u64, gateways: u64) -> Result<LeaseConfig, LeaseError> {
        if block == 0 {
            return Err(LeaseError::ZeroBlock);
        }
        if block > params.burst {
            return Err(LeaseError::BlockAboveBurst {
                block,
                burst: params.burst,
            });
        }
        Ok(LeaseConfig {
            params,
            block,
            gateways: gateways.max(1),
        })
    }

    /// Whether a holder with `held` tokens should ask for the next block: at or below 20% of
    /// `B`, compared exactly (`5 × held ≤ B`).
    #[inline]
    pub(crate) fn is_low(&self, held: u64) -> bool {
        held.saturating_mul(5) <= self.block
    }
}

/// The store's answer to a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grant {
    /// A whole block was taken from the bucket.
    Granted { tokens: u64 },
    /// The bucket held less than a block; don't ask again before this store time (µs).
    Denied { until_us: u64 },
}

/// LEASE, in the store: refill from the store's clock, then take a whole block or nothing.
/// The refilled state is written back either way, as a check does.
pub fn lease(cfg: &LeaseConfig, state: &mut Option<BucketState>, now: u64) -> Grant {
    let p = &cfg.params;
    let tokens = refill(p, *state, now);
    let need = p.units(cfg.block);
    let (left, answer) = if tokens >= need {
        (tokens - need, Grant::Granted { tokens: cfg.block })
    } else {
        let until_us = now.saturating_add(block_cycle_us(p, cfg.block, cfg.gateways));
        (tokens, Grant::Denied { until_us })
    };
    *state = Some(BucketState {
        tokens: left,
        ts: now,
        scale: p.scale,
    });
    answer
}

/// GIVE BACK, in the store: refill to `now`, add `tokens` unused tokens, cap at the burst.
pub fn give_back(p: &BucketParams, state: &mut Option<BucketState>, tokens: u64, now: u64) {
    *state = Some(bucket::give_back(p, *state, p.units(tokens), now));
}

/// One gateway's record in the store: tokens granted and not yet reported spent or given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HolderRecord {
    pub tokens: u64,
    /// Store time (µs) at and after which the next lease or give-back reclaims them.
    pub expires_us: u64,
}

/// A leased bucket's records, by the holder id each gateway picks at start.
pub type HolderRecords = BTreeMap<String, HolderRecord>;

/// What a lease or give-back call says about its caller's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Account<'a> {
    /// The gateway's holder id, chosen at start and kept until it exits.
    pub holder: &'a str,
    /// Tokens it spent from its blocks since its previous call on this bucket.
    pub spent: u64,
}

/// Removes the records that expired at or before `now` and returns their tokens.
pub fn sweep(records: &mut HolderRecords, now: u64) -> u64 {
    let mut back = 0u64;
    records.retain(|_, r| {
        if r.expires_us <= now {
            back = back.saturating_add(r.tokens);
            false
        } else {
            true
        }
    });
    back
}

/// Puts `tokens` reclaimed by [`sweep`] back in the bucket at `now`, capped at the burst: no
/// more than a burst is added, which is all a bucket can take.
fn reclaim(p: &BucketParams, state: &mut Option<BucketState>, tokens: u64, now: u64) {
    if tokens > 0 {
        *state = Some(bucket::give_back(p, *state, p.units(tokens.min(p.burst)), now));
    }
}

/// The caller's record after a call: what it spent and gave back comes off (never below 0),
/// then what it was granted goes on; it expires [`RECORD_TTL_US`] after `now`, and a record of 0
/// is removed. Returns the tokens now recorded.
fn note(records: &mut HolderRecords, acct: &Account<'_>, granted: u64, given: u64, now: u64) -> u64 {
    let before = records.get(acct.holder).map_or(0, |r| r.tokens);
    let tokens = before.saturating_sub(given.saturating_add(acct.spent)) + granted;
    if tokens == 0 {
        records.remove(acct.holder);
    } else {
        records.insert(
            acct.holder.to_string(),
            HolderRecord {
                tokens,
                expires_us: now.saturating_add(RECORD_TTL_US),
            },
        );
    }
    tokens
}

/// What the store answers to a recorded lease or give-back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recorded {
    /// Tokens of expired records put back in the bucket before the call (before the cap).
    pub reclaimed: u64,
    /// The caller's record after the call.
    pub held: u64,
}

/// LEASE with records (`lua/lease.lua`): reclaim expired records, then [`lease`], then note
/// the grant and the reported spending in the caller's record.
pub fn lease_recorded(
    cfg: &LeaseConfig,
    state: &mut Option<BucketState>,
    records: &mut HolderRecords,
    acct: &Account<'_>,
    now: u64,
) -> (Grant, Recorded) {
    let reclaimed = sweep(records, now);
    reclaim(&cfg.params, state, reclaimed, now);
    let grant = lease(cfg, state, now);
    let granted = match grant {
        Grant::Granted { tokens } => tokens,
        Grant::Denied { .. } => 0,
    };
    let held = note(records, acct, granted, 0, now);
    (grant, Recorded { reclaimed, held })
}

/// GIVE BACK with records: reclaim expired records, then [`give_back`], then take the tokens
/// given (at most a burst, as the store caps them) and the reported spending off the caller's
/// record.
pub fn give_back_recorded(
    p: &BucketParams,
    state: &mut Option<BucketState>,
    records: &mut HolderRecords,
    acct: &Account<'_>,
    tokens: u64,
    now: u64,
) -> Recorded {
    let reclaimed = sweep(records, now);
    reclaim(p, state, reclaimed, now);
    give_back(p, state, tokens.min(p.burst), now);
    let held = note(records, acct, 0, tokens.min(p.burst), now);
    Recorded { reclaimed, held }
}

/// One block a gateway holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Whole tokens left.
    pub left: u64,
    /// Gateway-clock time (µs) at which the unused rest goes back.
    pub expires_at: u64,
}

/// What [`Holder::spend`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spend {
    /// Paid from held tokens.
    pub admitted: bool,
    /// On a local limit, microseconds until `denied_until` (0 when no denial is pending, so
    /// `Retry-After` is its minimum of 1 s); `None` when no wait can help (cost above the burst).
    pub wait_us: Option<u64>,
    /// Send a LEASE now. The holder has marked it in flight; answer it with
    /// [`Holder::granted`] or [`Holder::denied`].
    pub ask: bool,
}

/// A gateway's tokens of one leased key: the blocks it holds, whether a lease is in flight,
/// and until when the store said no.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holder {
    /// Oldest first. Rarely more than two: the low block and the next one.
    blocks: SmallVec<[Block; 3]>,
    in_flight: bool,
    /// Gateway-clock time before which no LEASE is sent, jitter included.
    denied_until: u64,
}

impl Holder {
    pub fn new() -> Holder {
        Holder::default()
    }

    /// Whole tokens held, in every unexpired block.
    pub fn held(&self) -> u64 {
        self.blocks.iter().map(|b| b.left).sum()
    }

    /// Whole tokens held in blocks still unexpired at `now`, read without expiring any: what a
    /// look that must change nothing sees.
    pub fn held_at(&self, now: u64) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.expires_at > now)
            .map(|b| b.left)
            .sum()
    }

    pub fn in_flight(&self) -> bool {
        self.in_flight
    }

    pub fn denied_until(&self) -> u64 {
        self.denied_until
    }

    /// Drops blocks that expired at or before `now` and returns their unused tokens, which
    /// the caller gives back to the store (no call needed when it is 0).
    pub fn expire(&mut self, now: u64) -> u64 {
        let mut back = 0;
        self.blocks.retain(|b| {
            if b.expires_at <= now {
                back += b.left;
                false
            } else {
                true
            }
        });
        back
    }

    /// SPEND: pays `cost` from held tokens or refuses locally, then says whether to ask for
    /// the next block. Call [`Holder::expire`] first so an expired block is never spent.
    pub fn spend(&mut self, cfg: &LeaseConfig, now: u64, cost: u64) -> Spend {
        let held = self.held();
        let (admitted, wait_us) = if cost > cfg.params.burst {
            (false, None)
        } else if held >= cost {
            let mut due = cost;
            for b in self.blocks.iter_mut() {
                let take = due.min(b.left);
                b.left -= take;
                due -= take;
                if due == 0 {
                    break;
                }
            }
            self.blocks.retain(|b| b.left > 0);
            (true, Some(0))
        } else {
            (false, Some(self.denied_until.saturating_sub(now)))
        };
        // Low, or short of this request's cost (a cost above 20% of B can leave more than the
        // low-water mark and still too little): either way only a new block helps.
        let ask = !self.in_flight
            && now >= self.denied_until
            && ((!admitted && wait_us.is_some()) || cfg.is_low(self.held()));
        if ask {
            self.in_flight = true;
        }
        Spend {
            admitted,
            wait_us,
            ask,
        }
    }

    /// Puts back `tokens` that [`Holder::spend`] paid for a request that was then limited
    /// elsewhere (all-or-nothing). They go into the newest block still held at `now`; with no
    /// block left, they are returned for the caller to give back to the store.
    pub fn refund(&mut self, now: u64, tokens: u64) -> u64 {
        match self.blocks.iter_mut().rev().find(|b| b.expires_at > now) {
            Some(b) => {
                b.left += tokens;
                0
            }
            None => tokens,
        }
    }

    /// The store granted `tokens`; the answer reached the gateway at `now`.
    pub fn granted(&mut self, now: u64, tokens: u64) {
        self.in_flight = false;
        if tokens > 0 {
            self.blocks.push(Block {
                left: tokens,
                expires_at: now.saturating_add(BLOCK_TTL_US),
            });
        }
    }

    /// The store said no until `until_us`; the caller adds a random `jitter_us` in
    /// `0..=MAX_JITTER_US`. Store time is taken as gateway time: leases are short and the
    /// jitter dwarfs any skew that matters here.
    pub fn denied(&mut self, until_us: u64, jitter_us: u64) {
        self.in_flight = false;
        self.denied_until = until_us.saturating_add(jitter_us);
    }

    /// The lease call failed (store down, timeout): nothing granted, ask again on a later
    /// request.
    pub fn failed(&mut self) {
        self.in_flight = false;
    }

    /// A clean shutdown: returns every unused token for the caller to give back.
    pub fn drain(&mut self) -> u64 {
        let back = self.held();
        self.blocks.clear();
        back
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::Rate;

    fn kbig() -> LeaseConfig {
        let p = BucketParams::new(Rate::parse("10000/1s").unwrap(), 20_000).unwrap();
        LeaseConfig::new(p, auto_block(&p, 20), 20).unwrap()
    }

    #[test]
    fn hot_key_block_and_cycle() {
        let c = kbig();
        assert_eq!(c.block, 125);
        assert_eq!(block_cycle_us(&c.params, c.block, 20), 250_000);
        let small = BucketParams::new(Rate::parse("600/60s").unwrap(), 20).unwrap();
        assert_eq!(auto_block(&small, 20), 10);
        assert!(LeaseConfig::new(small, 21, 20).is_err());
        assert!(LeaseConfig::new(small, 0, 20).is_err());
        // 20% of 125 is 25: ask at 25 left, not at 26.
        assert!(c.is_low(25) && !c.is_low(26));
    }

    #[test]
    fn whole_block_or_nothing_then_denied_for_one_cycle() {
        let c = kbig();
        let mut s = None;
        for _ in 0..160 {
            assert_eq!(lease(&c, &mut s, 0), Grant::Granted { tokens: 125 });
        }
        assert_eq!(s.unwrap().tokens, 0);
        // 12.4 ms refill 124 tokens: one short of a block.
        assert_eq!(lease(&c, &mut s, 12_400), Grant::Denied { until_us: 262_400 });
        assert_eq!(lease(&c, &mut s, 12_500), Grant::Granted { tokens: 125 });
        assert_eq!(s.unwrap().tokens, 0);
    }

    #[test]
    fn give_back_caps_at_burst() {
        let c = kbig();
        let mut s = None;
        lease(&c, &mut s, 0);
        give_back(&c.params, &mut s, 100, 1_000);
        // 19,875 + 10 refilled + 100 back.
        assert_eq!(s.unwrap().tokens, 19_985 * c.params.scale);
        give_back(&c.params, &mut s, 125, 2_000);
        assert_eq!(s.unwrap().tokens, c.params.capacity);
    }

    #[test]
    fn holder_spends_asks_once_and_waits_out_a_denial() {
        let c = kbig();
        let mut h = Holder::new();
        // Nothing held: refuse locally, ask at once.
        let first = h.spend(&c, 0, 1);
        assert_eq!((first.admitted, first.wait_us, first.ask), (false, Some(0), true));
        // One lease in flight: no second ask.
        assert!(!h.spend(&c, 10, 1).ask);
        h.granted(1_000, 125);
        for i in 0..99 {
            let s = h.spend(&c, 1_000 + i, 1);
            assert!(s.admitted && !s.ask, "spend {i}");
        }
        // The 100th leaves 25 = 20%: ask.
        let s = h.spend(&c, 2_000, 1);
        assert!(s.admitted && s.ask);
        h.denied(252_000, 7_000);
        for _ in 0..25 {
            assert!(h.spend(&c, 3_000, 1).admitted);
        }
        let empty = h.spend(&c, 3_000, 1);
        assert_eq!(
            (empty.admitted, empty.wait_us, empty.ask),
            (false, Some(256_000), false)
        );
        assert!(!h.spend(&c, 258_999, 1).ask);
        assert!(h.spend(&c, 259_000, 1).ask);
    }

    #[test]
    fn a_request_short_of_its_cost_asks_even_above_the_low_water_mark() {
        let c = kbig();
        let mut h = Holder::new();
        h.spend(&c, 0, 1);
        h.granted(0, 125);
        assert!(h.spend(&c, 1, 80).admitted);
        // 45 left: above 25, yet a cost of 50 can't be paid. Ask once.
        let s = h.spend(&c, 2, 50);
        assert_eq!((s.admitted, s.ask), (false, true));
        assert!(!h.spend(&c, 3, 50).ask);
    }

    #[test]
    fn refunds_go_to_the_newest_block_or_back_to_the_store() {
        let c = kbig();
        let mut h = Holder::new();
        h.spend(&c, 0, 1);
        h.granted(0, 125);
        assert!(h.spend(&c, 1, 125).admitted);
        h.granted(10, 125);
        assert!(h.spend(&c, 11, 5).admitted);
        assert_eq!(h.refund(12, 5), 0);
        assert_eq!(h.held(), 125);
        assert_eq!(h.expire(10 + BLOCK_TTL_US), 125);
        // Nothing held any more: the refund is the store's.
        assert_eq!(h.refund(10 + BLOCK_TTL_US, 3), 3);
        assert_eq!(h.held(), 0);
    }

    #[test]
    fn a_silent_gateways_record_goes_back_after_its_expiry_and_a_live_one_never_does() {
        let c = kbig();
        let mut s = None;
        let mut recs = HolderRecords::new();
        let dead = Account {
            holder: "dead",
            spent: 0,
        };
        let live = |spent| Account {
            holder: "live",
            spent,
        };
        let (g, r) = lease_recorded(&c, &mut s, &mut recs, &dead, 0);
        assert_eq!((g, r.held), (Grant::Granted { tokens: 125 }, 125));
        lease_recorded(&c, &mut s, &mut recs, &live(0), 0);
        // The live gateway spends 100 of its block, asks for the next and reports them.
        let (_, r) = lease_recorded(&c, &mut s, &mut recs, &live(100), 1_000);
        assert_eq!((r.reclaimed, r.held), (0, 150));
        assert_eq!(s.unwrap().tokens, (20_000 - 375 + 10) * c.params.scale);
        // Its first block expires with 25 left: given back with nothing more spent.
        let r = give_back_recorded(&c.params, &mut s, &mut recs, &live(0), 25, BLOCK_TTL_US);
        assert_eq!((r.reclaimed, r.held), (0, 125));
        // One microsecond before the dead gateway's record expires nothing is reclaimed; at
        // its expiry its 125 go back (to a bucket that is full by then, so capped).
        let r = give_back_recorded(&c.params, &mut s, &mut recs, &live(0), 0, RECORD_TTL_US - 1);
        assert_eq!((r.reclaimed, recs.len()), (0, 2));
        let r = give_back_recorded(&c.params, &mut s, &mut recs, &live(125), 0, RECORD_TTL_US);
        assert_eq!((r.reclaimed, r.held), (125, 0));
        assert!(recs.is_empty(), "{recs:?}");
        assert_eq!(s.unwrap().tokens, c.params.capacity);
    }

    #[test]
    fn reclaimed_tokens_refill_a_drained_bucket_up_to_its_burst_only() {
        let p = BucketParams::new(Rate::parse("500/1s").unwrap(), 500).unwrap();
        let c = LeaseConfig::new(p, 200, 3).unwrap();
        let mut s = None;
        let mut recs = HolderRecords::new();
        for h in ["a", "b"] {
            let acct = Account { holder: h, spent: 0 };
            lease_recorded(&c, &mut s, &mut recs, &acct, 0);
        }
        assert_eq!(s.unwrap().tokens, 100 * p.scale);
        let c_acct = Account {
            holder: "c",
            spent: 0,
        };
        // 12 s later the bucket is full by refill alone; the 400 reclaimed change nothing.
        let (g, r) = lease_recorded(&c, &mut s, &mut recs, &c_acct, RECORD_TTL_US);
        assert_eq!(
            (g, r.reclaimed, r.held),
            (Grant::Granted { tokens: 200 }, 400, 200)
        );
        assert_eq!(s.unwrap().tokens, 300 * p.scale);
        // Reported spending never takes a record below 0, and a give-back of more than the
        // burst comes off as the burst.
        let big = Account {
            holder: "c",
            spent: 1_000,
        };
        let r = give_back_recorded(&p, &mut s, &mut recs, &big, 0, RECORD_TTL_US);
        assert_eq!(r.held, 0);
        assert!(recs.is_empty());
    }

    #[test]
    fn blocks_expire_and_oldest_is_spent_first() {
        let c = kbig();
        let mut h = Holder::new();
        h.spend(&c, 0, 1);
        h.granted(0, 125);
        for _ in 0..110 {
            h.spend(&c, 1, 1);
        }
        h.granted(5, 125);
        assert_eq!(h.held(), 140);
        assert!(h.spend(&c, 6, 20).admitted);
        // The old block (15 left) paid first, then 5 from the new one.
        assert_eq!(h.held(), 120);
        assert_eq!(
            h.blocks.iter().map(|b| b.expires_at).min(),
            Some(5 + BLOCK_TTL_US)
        );
        assert_eq!(h.expire(BLOCK_TTL_US + 4), 0);
        assert_eq!(h.expire(BLOCK_TTL_US + 5), 120);
        assert_eq!(h.held(), 0);
        assert_eq!(h.spend(&c, BLOCK_TTL_US + 5, 20_001).wait_us, None);
    }
}
