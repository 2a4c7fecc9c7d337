//! A request's leased items: each paid from its key's held blocks, refused locally, or left to
//! the inner store, which checks the rest of the request in one call; and the tokens a block
//! paid, put back when the request is refused or undelivered.

use smallvec::SmallVec;
use tokio::sync::watch;

use super::{Entry, Leases, State};
use crate::{Adjusted, CheckItem, Outcome, Source, StoreError};
use tollgate_limit::batch::LeaseBlock;
use tollgate_limit::bucket::{BucketParams, BucketVerdict};
use tollgate_limit::lease::{Holder, LeaseConfig};

/// What one leased item of a request got from its holder.
enum Try {
    /// Paid from held tokens; `held` whole tokens are left.
    Paid { held: u64 },
    /// Limited locally: not enough held, a denial pending for `wait_us`.
    Short { wait_us: u64, held: u64 },
    /// Nothing held and a lease in flight: wait for its answer.
    Wait(watch::Receiver<u64>),
    /// Check it in the store, through the guard.
    Store,
}

/// Where each item of a batch was decided.
#[derive(Clone, Copy)]
enum Local {
    /// In the store, or not at all when a leased item limited first.
    Store,
    Paid {
        held: u64,
    },
    /// A check of cost 0, read from this gateway's blocks without spending from them.
    Held {
        held: u64,
    },
    Short {
        wait_us: u64,
        held: u64,
    },
}

/// A leased bucket's verdict, its tokens the holder's, in the bucket's units.
fn verdict(p: &BucketParams, sufficient: bool, held: u64, wait_us: Option<u64>) -> BucketVerdict {
    BucketVerdict {
        sufficient,
        tokens: held.saturating_mul(p.scale),
        wait_us,
        blocked: false,
    }
}

/// The batch's items paid from held blocks, one bit each, as [`Outcome::leased`] keeps them.
fn leased_mask(local: &[Local]) -> u64 {
    local
        .iter()
        .enumerate()
        .filter(|(_, l)| matches!(l, Local::Paid { .. }))
        .fold(0u64, |m, (i, _)| m | (1 << i))
}

/// Each item's verdict as decided here; those left to the store are placeholders until its
/// answer replaces them.
fn local_verdicts(batch: &[CheckItem], local: &[Local]) -> SmallVec<[BucketVerdict; 4]> {
    batch
        .iter()
        .zip(local)
        .map(|(item, l)| {
            let p = &item.charge.params;
            match *l {
                Local::Paid { held } | Local::Held { held } => verdict(p, true, held, Some(0)),
                Local::Short { wait_us, held } => verdict(p, false, held, Some(wait_us)),
                // Not asked: only insufficient buckets decide a limited request.
                Local::Store => BucketVerdict {
                    sufficient: true,
                    tokens: p.capacity,
                    wait_us: Some(0),
                    blocked: false,
                },
            }
        })
        .collect()
}

impl Leases {
    /// What the key's holder does with one leased item: pays it, refuses it, makes it wait for
    /// the lease in flight, or leaves it to the store; and asks for the next block when due.
    fn try_spend(&self, st: &mut State, item: &CheckItem, size: LeaseBlock, now: u64, waited: bool) -> Try {
        if st.closed {
            return Try::Store;
        }
        let p = item.charge.params;
        let cost = item.charge.cost;
        let block = self.block_for(size, &p);
        let Ok(cfg) = LeaseConfig::new(p, block, u64::from(self.fleet.get())) else {
            return Try::Store;
        };
        if cost > block {
            return Try::Store;
        }
        let entry = st.keys.entry(item.fp).or_insert_with(|| Entry {
            key: item.key.clone(),
            params: p,
            holder: Holder::new(),
            failing_until: 0,
            answered: watch::Sender::new(0),
            unspoken: 0,
            last_call: 0,
            sync_armed: false,
        });
        entry.params = p;
        let back = entry.holder.expire(now);
        if back > 0 {
            self.metrics.lease_tokens_held.dec_by(back as i64);
            self.give_from(item.fp, entry, back, now);
        }
        if now < entry.failing_until && entry.holder.held() < cost {
            return Try::Store;
        }
        let s = entry.holder.spend(&cfg, now, cost);
        if s.admitted {
            entry.unspoken += cost;
        }
        if s.ask {
            let spent = std::mem::take(&mut entry.unspoken);
            self.called(item.fp, entry, now);
            self.send_lease(item.fp, entry.key.clone(), cfg, spent);
        }
        let held = entry.holder.held();
        if s.admitted {
            self.metrics.lease_tokens_held.dec_by(cost as i64);
            return Try::Paid { held };
        }
        match s.wait_us {
            // No denial pending, so a lease is in flight (spend just sent one if none was).
            Some(0) if waited => Try::Store,
            Some(0) => Try::Wait(entry.answered.subscribe()),
            Some(wait_us) => Try::Short { wait_us, held },
            // A cost above the burst never reaches here (cost <= block <= burst).
            None => Try::Store,
        }
    }

    /// Gives the enforced tokens paid by a request that was limited back to their holders.
    fn refund_refused(&self, batch: &[CheckItem], local: &[Local]) {
        // A limited request's shadow charges stand, as in the store.
        self.put_back(batch, |i| {
            matches!(local[i], Local::Paid { .. }) && !batch[i].charge.shadow
        });
    }

    /// Puts the tokens a block paid for the items `paid` selects back into their holders.
    fn put_back(&self, batch: &[CheckItem], paid: impl Fn(usize) -> bool) {
        let now = self.now_us();
        let mut st = self.lock();
        for (i, item) in batch.iter().enumerate() {
            if !paid(i) {
                continue;
            }
            let Some(e) = st.keys.get_mut(&item.fp) else {
                // Entries are never removed; still, paid tokens must not be lost.
                self.give_back_later(item.fp, item.key.clone(), item.charge.params, item.charge.cost, 0);
                continue;
            };
            let cost = item.charge.cost;
            let back = e.holder.refund(now, cost);
            // Back in a block or given back: either way no longer spent.
            e.unspoken = e.unspoken.saturating_sub(cost);
            self.metrics.lease_tokens_held.inc_by((cost - back) as i64);
            if back > 0 {
                self.give_from(item.fp, e, back, now);
            }
        }
    }

    /// Checks a batch with leased items: each paid by its holder or refused locally, and the
    /// rest of the request checked in the inner store in one call, unless a refusal came first.
    pub(super) async fn check_leased(&self, batch: &[CheckItem]) -> Result<Outcome, StoreError> {
        let (local, limited) = self.decide_locally(batch).await;
        let leased = leased_mask(&local);
        let mut verdicts = local_verdicts(batch, &local);
        if limited {
            // The store is not asked at all: a local limit costs the shard nothing.
            self.refund_refused(batch, &local);
            return Ok(Outcome {
                admitted: false,
                now_us: self.now_us(),
                buckets: verdicts,
                source: Source::Store,
                leased,
            });
        }
        let rest: SmallVec<[CheckItem; 4]> = batch
            .iter()
            .zip(&local)
            .filter(|(_, l)| matches!(l, Local::Store))
            .map(|(item, _)| item.clone())
            .collect();
        if rest.is_empty() {
            return Ok(Outcome {
                admitted: true,
                now_us: self.now_us(),
                buckets: verdicts,
                source: Source::Store,
                leased,
            });
        }
        let out = match self.inner.check(&rest).await {
            Ok(o) => o,
            Err(e) => {
                self.refund_refused(batch, &local);
                return Err(e);
            }
        };
        if !out.admitted {
            self.refund_refused(batch, &local);
        }
        let mut from_store = out.buckets.into_iter();
        for (v, l) in verdicts.iter_mut().zip(&local) {
            if matches!(l, Local::Store)
                && let Some(s) = from_store.next()
            {
                *v = s;
            }
        }
        Ok(Outcome {
            admitted: out.admitted,
            now_us: out.now_us,
            buckets: verdicts,
            source: out.source,
            leased,
        })
    }

    /// Decides a batch's leased items in order, stopping at the first enforced local refusal;
    /// also says whether one came, since then the store must not be asked.
    async fn decide_locally(&self, batch: &[CheckItem]) -> (SmallVec<[Local; 4]>, bool) {
        let mut local: SmallVec<[Local; 4]> = SmallVec::from_elem(Local::Store, batch.len());
        for (i, item) in batch.iter().enumerate() {
            // Outcome::leased has room for 64 items; any further ones go to the store.
            let Some(size) = item.lease.filter(|_| i < 64) else {
                continue;
            };
            if item.charge.cost == 0 {
                // A peek (the usage route's read of a bucket it does not charge) must neither
                // lease nor count as spending, or merely looking would pull blocks out of the
                // store. It sees what a request paid from the blocks is told is left; with
                // nothing held, the store's bucket.
                let held = self.held_now(item);
                if held > 0 {
                    local[i] = Local::Held { held };
                }
                continue;
            }
            local[i] = self.spend_leased(item, size).await;
            if matches!(local[i], Local::Short { .. }) && !item.charge.shadow {
                return (local, true);
            }
        }
        (local, false)
    }

    /// Whole tokens this gateway holds for the item's key now, none spent.
    fn held_now(&self, item: &CheckItem) -> u64 {
        let now = self.now_us();
        self.lock()
            .keys
            .get(&item.fp)
            .map_or(0, |e| e.holder.held_at(now))
    }

    /// Spends one leased item from its holder, waiting (once) for a lease in flight when
    /// nothing is held.
    async fn spend_leased(&self, item: &CheckItem, size: LeaseBlock) -> Local {
        // A shadow limit never makes a request wait.
        let mut waited = item.charge.shadow;
        loop {
            let t = {
                let mut st = self.lock();
                self.try_spend(&mut st, item, size, self.now_us(), waited)
            };
            match t {
                Try::Wait(mut rx) => {
                    waited = true;
                    let _ = tokio::time::timeout(self.wait, rx.changed()).await;
                }
                Try::Paid { held } => return Local::Paid { held },
                Try::Short { wait_us, held } => return Local::Short { wait_us, held },
                Try::Store => return Local::Store,
            }
        }
    }

    /// A refund of a request some blocks paid for: their tokens go back to the blocks, the rest
    /// of the request to the inner store's refund.
    pub(super) async fn adjust_leased(
        &self,
        batch: &[CheckItem],
        outcome: &Outcome,
        units: &[i64],
    ) -> Result<Adjusted, StoreError> {
        self.put_back(batch, |i| outcome.is_leased(i) && units[i] > 0);
        let mut rest: SmallVec<[CheckItem; 4]> = SmallVec::new();
        let mut rest_units: SmallVec<[i64; 4]> = SmallVec::new();
        let mut places: SmallVec<[usize; 4]> = SmallVec::new();
        for (i, item) in batch.iter().enumerate() {
            if !outcome.is_leased(i) && units[i] != 0 {
                rest.push(item.clone());
                rest_units.push(units[i]);
                places.push(i);
            }
        }
        let mut out = Adjusted::none(batch.len());
        if rest.is_empty() {
            return Ok(out);
        }
        let rest_outcome = Outcome {
            leased: 0,
            ..outcome.part(&places)
        };
        let got = self.inner.adjust(&rest, &rest_outcome, &rest_units).await?;
        out.now_us = got.now_us;
        for (j, &i) in places.iter().enumerate() {
            out.balances[i] = got.balances[j];
        }
        Ok(out)
    }
}
