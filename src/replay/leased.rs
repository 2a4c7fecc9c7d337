//! The `lease` design on a virtual clock: every gateway runs `limit::lease::Holder`, the store
//! runs `limit::lease::{lease, give_back}`, and store calls take a modelled round trip, so a
//! lease is in flight for a while as it would be over a network.
//!
//! A LEASE sent at `t` is applied by the store at `t + rtt/2` (on the store's clock, which in a
//! replay is the one virtual clock) and its answer reaches the gateway at `t + rtt`. A block
//! expires 10 s after it reached the gateway; its unused tokens are sent back, applied at
//! `expiry + rtt/2`. Events due at or before a row's time happen before that row.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::algorithms::Verdict;
use tollgate_limit::bucket::BucketState;
use tollgate_limit::lease::{BLOCK_TTL_US, Grant, Holder, LeaseConfig, MAX_JITTER_US, give_back, lease};

#[derive(Clone, Copy, Debug)]
enum Event {
    /// The store runs a LEASE for (key, gateway).
    StoreLease { key: u32, gw: u32 },
    /// Its answer reaches the gateway.
    Answer { key: u32, gw: u32, grant: Grant },
    /// A block the gateway holds may have expired.
    Expire { key: u32, gw: u32 },
    /// The store adds unused tokens back.
    GiveBack { key: u32, tokens: u64 },
}

struct Due {
    at: u64,
    seq: u64,
    event: Event,
}

impl PartialEq for Due {
    fn eq(&self, o: &Due) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, o: &Due) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Due {
    // Reversed: BinaryHeap is a max-heap and we want the earliest (then the first scheduled).
    fn cmp(&self, o: &Due) -> Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

/// Every gateway's holders and the store's buckets for the keys of one replay.
pub struct LeaseFleet {
    cfg: LeaseConfig,
    gateways: u64,
    rtt_us: u64,
    rng: StdRng,
    /// The store's bucket per key.
    buckets: Vec<Option<BucketState>>,
    /// Per key × gateway.
    holders: Vec<Holder>,
    queue: BinaryHeap<Due>,
    seq: u64,
    pub store_calls: u64,
    /// Leases granted and denied, for the report.
    pub grants: u64,
    pub denials: u64,
}

impl LeaseFleet {
    pub fn new(cfg: LeaseConfig, gateways: u64, rtt_us: u64, seed: u64) -> LeaseFleet {
        LeaseFleet {
            cfg,
            gateways,
            rtt_us,
            rng: StdRng::seed_from_u64(seed),
            buckets: Vec::new(),
            holders: Vec::new(),
            queue: BinaryHeap::new(),
            seq: 0,
            store_calls: 0,
            grants: 0,
            denials: 0,
        }
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.cfg
    }

    fn push(&mut self, at: u64, event: Event) {
        self.seq += 1;
        self.queue.push(Due {
            at,
            seq: self.seq,
            event,
        });
    }

    fn ensure_key(&mut self, key: u32) {
        let k = key as usize + 1;
        if self.buckets.len() < k {
            self.buckets.resize(k, None);
            self.holders.resize_with(k * self.gateways as usize, Holder::new);
        }
    }

    fn holder(&mut self, key: u32, gw: u32) -> &mut Holder {
        &mut self.holders[key as usize * self.gateways as usize + gw as usize]
    }

    /// Runs every store call, answer and expiry due at or before `now`.
    pub fn advance(&mut self, now: u64) {
        while self.queue.peek().is_some_and(|d| d.at <= now) {
            let Some(Due { at, event, .. }) = self.queue.pop() else {
                break;
            };
            match event {
                Event::StoreLease { key, gw } => {
                    let grant = lease(&self.cfg, &mut self.buckets[key as usize], at);
                    match grant {
                        Grant::Granted { .. } => self.grants += 1,
                        Grant::Denied { .. } => self.denials += 1,
                    }
                    let back = at + (self.rtt_us - self.rtt_us / 2);
                    self.push(back, Event::Answer { key, gw, grant });
                }
                Event::Answer { key, gw, grant } => match grant {
                    Grant::Granted { tokens } => {
                        self.holder(key, gw).granted(at, tokens);
                        self.push(at + BLOCK_TTL_US, Event::Expire { key, gw });
                    }
                    Grant::Denied { until_us } => {
                        let jitter = self.rng.random_range(0..=MAX_JITTER_US);
                        self.holder(key, gw).denied(until_us, jitter);
                    }
                },
                Event::Expire { key, gw } => {
                    let back = self.holder(key, gw).expire(at);
                    if back > 0 {
                        self.store_calls += 1;
                        self.push(at + self.rtt_us / 2, Event::GiveBack { key, tokens: back });
                    }
                }
                Event::GiveBack { key, tokens } => {
                    give_back(&self.cfg.params, &mut self.buckets[key as usize], tokens, at);
                }
            }
        }
    }

    /// One request for `key` at gateway `gw` at `now`: spent from the gateway's blocks or
    /// limited locally, and a LEASE sent if the holder asks for one.
    pub fn check(&mut self, key: u32, gw: u32, now: u64, cost: u64) -> Verdict {
        self.ensure_key(key);
        self.advance(now);
        let cfg = self.cfg;
        let spend = self.holder(key, gw).spend(&cfg, now, cost);
        if spend.ask {
            self.store_calls += 1;
            self.push(now + self.rtt_us / 2, Event::StoreLease { key, gw });
        }
        if spend.admitted {
            Verdict::ALLOW
        } else {
            Verdict::refuse(spend.wait_us)
        }
    }

    /// Tokens the gateways hold for `key` right now (received, unexpired, unspent).
    pub fn held(&self, key: u32) -> u64 {
        let g = self.gateways as usize;
        let start = key as usize * g;
        self.holders
            .get(start..start + g)
            .map(|hs| hs.iter().map(Holder::held).sum())
            .unwrap_or(0)
    }

    /// Whole tokens in the store's bucket for `key`, refilled to `now`.
    pub(crate) fn bucket_tokens(&self, key: u32, now: u64) -> u64 {
        let p = &self.cfg.params;
        let state = self.buckets.get(key as usize).copied().flatten();
        tollgate_limit::bucket::refill(p, state, now) / p.scale
    }
}
