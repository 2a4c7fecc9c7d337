//! Leased blocks in the gateway: a hot key's bucket spent from this gateway's memory, with the
//! store asked once a block (`lua/lease.lua`) instead of once a request. A [`Store`] in front
//! of the guard.
//!
//! For every batch item whose limit is leased, [`Leases`] runs the pure holder of
//! [`tollgate_limit::lease`] per bucket (per key): spend a held token, or refuse locally with
//! `Retry-After` from `denied_until`; at 20% of the block ask for the next one in the
//! background (one lease in flight per key, never before `denied_until` plus 0–50 ms of
//! jitter); a block expires 10 s after it arrived, on this gateway's monotonic clock, and its
//! unused tokens go back to the store, as every held token does on [`Leases::drain`] (graceful
//! shutdown). Items that are not leased go to the inner store (the guard) in one call, so a
//! request is still all-or-nothing: its leased tokens are reserved first, and given back to
//! the holder when the store refuses the rest.
//!
//! Two departures from plain leasing (admit while the local block has a token, refuse locally
//! when it is empty), both to keep leasing invisible to a key that is leased but not hot at the
//! moment:
//! - A holder with nothing left and a lease in flight (not denied) makes the request wait for
//!   the answer, up to the store timeout, instead of refusing it: otherwise the first request
//!   after an idle spell would get a 429 from a full bucket. No answer in time: the item is
//!   checked in the store like an unleased one.
//! - A request that costs more than a block is checked in the store directly (the same bucket,
//!   the same encoding): a holder could never pay it.
//!
//! When a lease call fails (error or no answer within [`LEASE_CALL_TIMEOUT`]) the key's items
//! are checked through the guard for [`RETRY_AFTER_FAILURE`]: while the store is down the
//! guard's breaker and the limit's failure policy decide, exactly as for unleased limits, and
//! tokens already held are still spent. The one lease a second per key that then finds the store
//! back turns leasing on again.
//!
//! An item of cost 0 only reads its bucket (the usage route's peeks): it never spends from a
//! block, asks for one or counts as spending. It is answered with the tokens this gateway's
//! unexpired blocks hold, as a request paid from them is told, or by the store when they hold
//! none.
//!
//! A refund of an undelivered request ([`Store::refund`]) puts the tokens a block paid back into
//! this gateway's newest unexpired block of that key (or gives them back to the store when none is
//! left), and sends the rest of the request to the inner store's refund. The outcome says which
//! items a block paid (`Outcome::leased`); only the first 64 items of a request are leased.
//!
//! A gateway killed with -9 gives nothing back, so the store keeps a record per gateway of what
//! it holds (`tollgate_limit::lease` [`Records`](tollgate_limit::lease::Records)): this gateway
//! has a holder id of its own, and every lease and give-back reports the tokens it spent from
//! that key's blocks since its previous call. A record expires 12 s after the gateway's last
//! call, when the store puts its tokens back; so that a live gateway's never does, one that has
//! spent since its last call and has nothing else to send sends a give-back of nothing 11 s after
//! it (a sync). A call that fails counts what it carried as spent, so the record can only come
//! out low (an undershoot, as a lost give-back is), never high.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use smallvec::SmallVec;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::guard::FleetSize;
use super::{Adjusted, BoxFuture, CheckFuture, CheckItem, Outcome, Source, Store, StoreError};
use tollgate_limit::batch::LeaseBlock;
use tollgate_limit::bucket::{BucketParams, BucketVerdict};
use tollgate_limit::lease::{
    Account, BLOCK_TTL_US, Grant, Holder, LeaseConfig, MAX_JITTER_US, RECORD_GRACE_US, Recorded, auto_block,
    block_cycle_us,
};
use tollgate_telemetry::logsample::Sampler;
use tollgate_telemetry::metrics::{Kind, Metrics};

/// A lease call that has not answered in this long counts as failed. Longer than a check's
/// budget: it runs off the request path, and a late grant is still tokens to spend.
pub(crate) const LEASE_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// After a failed lease call, the key is checked through the guard, and no lease is sent for
/// it, for this long.
pub(crate) const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(1);

/// A key with spending its store record does not know and no call for this long gets a sync:
/// after the block TTL, so the give-back of a block leased by that last call (whose answer
/// took at most [`LEASE_CALL_TIMEOUT`]) goes first and carries it; and half the record's grace
/// before the store's record of this gateway expires.
const SYNC_AFTER_US: u64 = BLOCK_TTL_US + RECORD_GRACE_US / 2;

/// The store's answer to a LEASE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseReply {
    /// A whole block, or nothing until a store time.
    pub grant: Grant,
    /// The store time the script used (µs).
    pub now_us: u64,
    /// Units left in the bucket after the call.
    pub units_left: u64,
    /// Tokens of silent gateways reclaimed, and the caller's record after the call.
    pub recorded: Recorded,
}

/// The store's answer to a GIVE BACK.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GiveBackReply {
    pub now_us: u64,
    pub units_left: u64,
    pub recorded: Recorded,
}

/// The key of a leased bucket's records: the bucket's name, hash tag included, so one script
/// on one shard reads both, and a suffix no bucket name ends with.
pub fn held_key(bucket: &str) -> String {
    format!("{bucket}|held")
}

/// A store that can lease blocks: `lua/lease.lua` in Redis. Both calls reclaim the records of
/// gateways silent past their expiry first, and update the caller's record (`acct`).
pub trait Lessor: Send + Sync + 'static {
    /// A whole block of `block` tokens, or nothing and `now + cycle_us`.
    fn lease<'a>(
        &'a self,
        key: &'a str,
        p: &'a BucketParams,
        block: u64,
        cycle_us: u64,
        acct: Account<'a>,
    ) -> BoxFuture<'a, Result<LeaseReply, StoreError>>;

    /// Adds `tokens` unused tokens back, capped at the burst.
    fn give_back<'a>(
        &'a self,
        key: &'a str,
        p: &'a BucketParams,
        tokens: u64,
        acct: Account<'a>,
    ) -> BoxFuture<'a, Result<GiveBackReply, StoreError>>;
}

/// One leased bucket in this gateway.
struct Entry {
    key: Arc<str>,
    /// The numbers last seen for it, for give-backs (a reload may change them).
    params: BucketParams,
    holder: Holder,
    /// Gateway time before which the key goes through the guard unless it holds tokens.
    failing_until: u64,
    /// Bumped on every lease answer, for requests waiting on one.
    answered: watch::Sender<u64>,
    /// Tokens spent from blocks (net of refunds) not yet reported to the store's record.
    unspoken: u64,
    /// Gateway time of the last lease or give-back sent for the key.
    last_call: u64,
    /// A sync timer is running for the key.
    sync_armed: bool,
}

struct State {
    keys: HashMap<u64, Entry>,
    /// Draining for shutdown: nothing more is leased, grants that still arrive go back.
    closed: bool,
}

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

/// Every leased bucket of this gateway, in front of the guarded store.
pub struct Leases {
    inner: Arc<dyn Store>,
    lessor: Arc<dyn Lessor>,
    fleet: Arc<FleetSize>,
    metrics: Arc<Metrics>,
    /// How long a request waits for a lease in flight.
    wait: Duration,
    origin: Instant,
    state: Mutex<State>,
    /// Lease and give-back calls not yet finished, for the drain.
    calls: AtomicUsize,
    idle: Notify,
    warn: Sampler,
    /// This gateway's name in the store's records, picked at start.
    holder: Arc<str>,
    me: Weak<Leases>,
}

fn verdict(p: &BucketParams, sufficient: bool, held: u64, wait_us: Option<u64>) -> BucketVerdict {
    BucketVerdict {
        sufficient,
        tokens: held.saturating_mul(p.scale),
        wait_us,
    }
}

impl Leases {
    /// `inner` checks everything that is not spent from a block (the guard); `lessor` leases
    /// (the Redis store behind it); `wait` is how long a request may wait for a lease answer
    /// (the store timeout).
    pub fn new(
        inner: Arc<dyn Store>,
        lessor: Arc<dyn Lessor>,
        fleet: Arc<FleetSize>,
        metrics: Arc<Metrics>,
        wait: Duration,
    ) -> Arc<Leases> {
        Arc::new_cyclic(|me| Leases {
            inner,
            lessor,
            fleet,
            metrics,
            wait,
            origin: Instant::now(),
            state: Mutex::new(State {
                keys: HashMap::new(),
                closed: false,
            }),
            calls: AtomicUsize::new(0),
            idle: Notify::new(),
            warn: Sampler::new(Duration::from_secs(5)),
            holder: format!("{:032x}", rand::random::<u128>()).into(),
            me: me.clone(),
        })
    }

    /// Microseconds on this gateway's monotonic clock.
    fn now_us(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing under this lock can leave the state half-changed, so a panic elsewhere
        // while holding it does not make it unusable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whole tokens this gateway holds now, every key.
    pub fn held(&self) -> u64 {
        self.lock().keys.values().map(|e| e.holder.held()).sum()
    }

    /// Whole tokens this gateway holds for one bucket.
    pub fn held_for(&self, key: &str) -> u64 {
        self.lock()
            .keys
            .values()
            .filter(|e| &*e.key == key)
            .map(|e| e.holder.held())
            .sum()
    }

    /// This gateway's holder id in the store's records.
    pub fn holder_id(&self) -> &str {
        &self.holder
    }

    /// Lease and give-back calls still running.
    pub fn calls_in_flight(&self) -> usize {
        self.calls.load(Ordering::Acquire)
    }

    /// The block size for these numbers now: fixed, or `max(10, ⌈0.25 s × r / N⌉)` with the
    /// current fleet size; never above the burst, which a bucket could not hold.
    pub fn block_for(&self, size: LeaseBlock, p: &BucketParams) -> u64 {
        match size {
            LeaseBlock::Auto => auto_block(p, u64::from(self.fleet.get())),
            LeaseBlock::Fixed(b) => b,
        }
        .min(p.burst)
    }

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

    async fn check_leased(&self, batch: &[CheckItem]) -> Result<Outcome, StoreError> {
        let mut local: SmallVec<[Local; 4]> = SmallVec::from_elem(Local::Store, batch.len());
        let mut limited = false;
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
                let now = self.now_us();
                let held = self
                    .lock()
                    .keys
                    .get(&item.fp)
                    .map_or(0, |e| e.holder.held_at(now));
                if held > 0 {
                    local[i] = Local::Held { held };
                }
                continue;
            }
            // A shadow limit never makes a request wait.
            let mut waited = item.charge.shadow;
            loop {
                let t = {
                    let mut st = self.lock();
                    self.try_spend(&mut st, item, size, self.now_us(), waited)
                };
                local[i] = match t {
                    Try::Wait(mut rx) => {
                        waited = true;
                        let _ = tokio::time::timeout(self.wait, rx.changed()).await;
                        continue;
                    }
                    Try::Paid { held } => Local::Paid { held },
                    Try::Short { wait_us, held } => {
                        limited |= !item.charge.shadow;
                        Local::Short { wait_us, held }
                    }
                    Try::Store => Local::Store,
                };
                break;
            }
            if limited {
                break;
            }
        }

        let leased = local
            .iter()
            .enumerate()
            .filter(|(_, l)| matches!(l, Local::Paid { .. }))
            .fold(0u64, |m, (i, _)| m | (1 << i));
        let mut verdicts: SmallVec<[BucketVerdict; 4]> = batch
            .iter()
            .zip(&local)
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
                    },
                }
            })
            .collect();
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

    fn call_started(&self) {
        self.calls.fetch_add(1, Ordering::AcqRel);
    }

    fn call_done(&self) {
        if self.calls.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Notes a call about to be sent for the key, and makes sure a sync timer runs.
    fn called(&self, fp: u64, e: &mut Entry, now: u64) {
        e.last_call = now;
        if !e.sync_armed {
            e.sync_armed = true;
            self.sync_at(fp, now + SYNC_AFTER_US);
        }
    }

    /// Gives `tokens` back for an entry, with what it spent since its last call.
    fn give_from(&self, fp: u64, e: &mut Entry, tokens: u64, now: u64) {
        let spent = std::mem::take(&mut e.unspoken);
        self.called(fp, e, now);
        self.give_back_later(fp, e.key.clone(), e.params, tokens, spent);
    }

    /// A call failed, so the store may or may not have applied it: what it carried counts as
    /// spent, and the next call takes it off the record, which then errs low.
    fn call_failed(&self, fp: u64, carried: u64) {
        if let Some(e) = self.lock().keys.get_mut(&fp) {
            e.unspoken = e.unspoken.saturating_add(carried);
        }
    }

    /// Runs `then` on the key's entry, under the lock, once `at_us` has passed on this gateway's
    /// clock; nothing if the gateway or the key is gone by then.
    fn on_key_at(&self, fp: u64, at_us: u64, then: impl FnOnce(&Leases, &mut Entry, u64) + Send + 'static) {
        let weak = self.me.clone();
        let deadline = self.origin + Duration::from_micros(at_us);
        tokio::spawn(async move {
            tokio::time::sleep_until(deadline).await;
            let Some(me) = weak.upgrade() else { return };
            let now = me.now_us();
            let mut st = me.lock();
            if let Some(e) = st.keys.get_mut(&fp) {
                then(&me, e, now);
            }
        });
    }

    /// At `at_us`: if no call for the key went out for [`SYNC_AFTER_US`] and tokens were spent
    /// since the last one, a give-back of nothing reports them, before the store's record of
    /// this gateway expires and hands back what it has already spent.
    fn sync_at(&self, fp: u64, at_us: u64) {
        self.on_key_at(fp, at_us, move |me, e, now| {
            e.sync_armed = false;
            let due = e.last_call + SYNC_AFTER_US;
            if due > now {
                e.sync_armed = true;
                me.sync_at(fp, due);
            } else if e.unspoken > 0 {
                me.give_from(fp, e, 0, now);
            }
        });
    }

    fn send_lease(&self, fp: u64, key: Arc<str>, cfg: LeaseConfig, spent: u64) {
        let Some(me) = self.me.upgrade() else { return };
        self.call_started();
        self.metrics
            .lease_calls
            .get_or_create(&Kind { kind: "lease" })
            .inc();
        tokio::spawn(async move {
            let cycle = block_cycle_us(&cfg.params, cfg.block, cfg.gateways);
            let acct = Account {
                holder: &me.holder,
                spent,
            };
            let answer = tokio::time::timeout(
                LEASE_CALL_TIMEOUT,
                me.lessor.lease(&key, &cfg.params, cfg.block, cycle, acct),
            )
            .await
            .unwrap_or(Err(StoreError::Timeout));
            if answer.is_err() {
                // Its block may have been granted and the answer lost.
                me.call_failed(fp, spent.saturating_add(cfg.block));
            }
            me.answered(fp, key, cfg.params, answer);
            me.call_done();
        });
    }

    fn answered(&self, fp: u64, key: Arc<str>, p: BucketParams, answer: Result<LeaseReply, StoreError>) {
        let now = self.now_us();
        let mut st = self.lock();
        let closed = st.closed;
        let Some(e) = st.keys.get_mut(&fp) else {
            // Entries are never removed; still, granted tokens must not be lost.
            if let Ok(LeaseReply {
                grant: Grant::Granted { tokens },
                ..
            }) = answer
            {
                self.give_back_later(fp, key, p, tokens, 0);
            }
            return;
        };
        match answer {
            Ok(LeaseReply {
                grant: Grant::Granted { tokens },
                ..
            }) => {
                self.metrics.lease_grants.inc();
                self.metrics.lease_tokens_granted.inc_by(tokens);
                if closed {
                    e.holder.failed();
                    self.give_from(fp, e, tokens, now);
                } else {
                    e.holder.granted(now, tokens);
                    e.failing_until = 0;
                    self.metrics.lease_tokens_held.inc_by(tokens as i64);
                    self.expire_at(fp, now + BLOCK_TTL_US);
                }
            }
            Ok(LeaseReply {
                grant: Grant::Denied { until_us },
                now_us,
                ..
            }) => {
                self.metrics.lease_denials.inc();
                e.failing_until = 0;
                // The store's time and ours differ: carry over the wait, not the instant.
                let until = now.saturating_add(until_us.saturating_sub(now_us));
                e.holder.denied(until, rand::random_range(0..=MAX_JITTER_US));
            }
            Err(err) => {
                self.metrics
                    .lease_failures
                    .get_or_create(&Kind { kind: "lease" })
                    .inc();
                let retry = now + RETRY_AFTER_FAILURE.as_micros() as u64;
                e.failing_until = retry;
                e.holder.denied(retry, 0);
                if let Some(suppressed) = self.warn.allow(0) {
                    tracing::warn!(error = %err, suppressed, "lease call failed; leased limits are checked through the store guard for 1 s");
                }
            }
        }
        e.answered.send_modify(|n| *n += 1);
    }

    /// Expires the key's blocks once `at_us` has passed, and sends their rest back.
    fn expire_at(&self, fp: u64, at_us: u64) {
        self.on_key_at(fp, at_us, move |me, e, now| {
            let back = e.holder.expire(now);
            if back > 0 {
                me.metrics.lease_tokens_held.dec_by(back as i64);
                me.give_from(fp, e, back, now);
            }
        });
    }

    fn give_back_later(&self, fp: u64, key: Arc<str>, p: BucketParams, tokens: u64, spent: u64) {
        let Some(me) = self.me.upgrade() else { return };
        self.call_started();
        self.metrics
            .lease_calls
            .get_or_create(&Kind { kind: "give_back" })
            .inc();
        tokio::spawn(async move {
            let acct = Account {
                holder: &me.holder,
                spent,
            };
            let r =
                tokio::time::timeout(LEASE_CALL_TIMEOUT, me.lessor.give_back(&key, &p, tokens, acct)).await;
            match r {
                Ok(Ok(_)) => {
                    me.metrics.lease_tokens_returned.inc_by(tokens);
                }
                Ok(Err(_)) | Err(_) => {
                    me.call_failed(fp, spent.saturating_add(tokens));
                    // Lost to this bucket until it refills: an undershoot, never an overshoot.
                    me.metrics
                        .lease_failures
                        .get_or_create(&Kind { kind: "give_back" })
                        .inc();
                }
            }
            me.call_done();
        });
    }

    /// Graceful shutdown: stops leasing, gives every held token back, and waits (at most
    /// `within`) for every lease and give-back call to finish, so grants still on their way
    /// go back too. Returns the tokens it gave back from the holders.
    pub async fn drain(&self, within: Duration) -> u64 {
        let deadline = Instant::now() + within;
        let mut given = 0;
        {
            let now = self.now_us();
            let mut st = self.lock();
            st.closed = true;
            for (&fp, e) in st.keys.iter_mut() {
                let t = e.holder.drain();
                if t > 0 {
                    given += t;
                    self.metrics.lease_tokens_held.dec_by(t as i64);
                }
                // Spent tokens are reported too, so a clean exit leaves no record to reclaim.
                if t > 0 || e.unspoken > 0 {
                    self.give_from(fp, e, t, now);
                }
            }
        }
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            let left = self.calls.load(Ordering::Acquire);
            if left == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                tracing::warn!(
                    calls = left,
                    "shutdown: lease calls still unanswered; their tokens come back as the bucket refills"
                );
                break;
            }
        }
        given
    }
}

impl Store for Leases {
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        if batch.iter().all(|i| i.lease.is_none()) {
            return self.inner.check(batch);
        }
        CheckFuture::Boxed(Box::pin(self.check_leased(batch)))
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    /// A leased item's tokens go back to its block (only a refund reaches one: post-paid limits
    /// can't lease); the rest go to the store.
    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
        if outcome.leased == 0 || crate::units_mismatch(batch, outcome, units).is_some() {
            return self.inner.adjust(batch, outcome, units);
        }
        Box::pin(async move {
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
        })
    }

    fn ping(&self) -> CheckFuture<'_> {
        self.inner.ping()
    }

    fn heartbeat<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Option<u32>, StoreError>> {
        self.inner.heartbeat(instance)
    }

    fn remote(&self) -> bool {
        self.inner.remote()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FailurePolicy;
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use tollgate_limit::bucket::{BucketState, Charge, Rate};
    use tollgate_limit::lease::{Records, give_back_recorded, lease_recorded};

    /// A store in memory on tokio's (paused) clock: leases by `limit::lease`, checks answered
    /// as told, and a switch that makes every lease call fail.
    struct Fake {
        origin: Instant,
        bucket: Mutex<Option<BucketState>>,
        records: Mutex<Records>,
        fail: AtomicBool,
        /// Lease answers take this long (virtual ms).
        delay_ms: AtomicU64,
        leases: AtomicU64,
        given: Mutex<Vec<u64>>,
        checks: AtomicU64,
        refuse_checks: AtomicBool,
        /// The keys of every batch refunded through this store.
        refunded: Mutex<Vec<Vec<String>>>,
    }

    impl Fake {
        fn new() -> Arc<Fake> {
            Arc::new(Fake {
                origin: Instant::now(),
                bucket: Mutex::new(None),
                records: Mutex::new(Records::new()),
                fail: AtomicBool::new(false),
                delay_ms: AtomicU64::new(0),
                leases: AtomicU64::new(0),
                given: Mutex::new(Vec::new()),
                checks: AtomicU64::new(0),
                refuse_checks: AtomicBool::new(false),
                refunded: Mutex::new(Vec::new()),
            })
        }

        fn now(&self) -> u64 {
            // A store clock far from the gateway's, as Redis TIME is.
            1_700_000_000_000_000 + self.origin.elapsed().as_micros() as u64
        }
    }

    impl Lessor for Fake {
        fn lease<'a>(
            &'a self,
            _key: &'a str,
            p: &'a BucketParams,
            block: u64,
            cycle_us: u64,
            acct: Account<'a>,
        ) -> BoxFuture<'a, Result<LeaseReply, StoreError>> {
            Box::pin(async move {
                self.leases.fetch_add(1, Ordering::SeqCst);
                let delay = self.delay_ms.load(Ordering::SeqCst);
                if delay > 0 {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                if self.fail.load(Ordering::SeqCst) {
                    return Err(StoreError::Unavailable("connection refused".into()));
                }
                let now = self.now();
                let cfg = LeaseConfig::new(*p, block, 1).unwrap();
                let mut b = self.bucket.lock().unwrap();
                let mut recs = self.records.lock().unwrap();
                let (grant, recorded) = lease_recorded(&cfg, &mut b, &mut recs, &acct, now);
                let grant = match grant {
                    Grant::Denied { .. } => Grant::Denied {
                        until_us: now + cycle_us,
                    },
                    g => g,
                };
                Ok(LeaseReply {
                    grant,
                    now_us: now,
                    units_left: b.unwrap().tokens,
                    recorded,
                })
            })
        }

        fn give_back<'a>(
            &'a self,
            _key: &'a str,
            p: &'a BucketParams,
            tokens: u64,
            acct: Account<'a>,
        ) -> BoxFuture<'a, Result<GiveBackReply, StoreError>> {
            Box::pin(async move {
                let now = self.now();
                let mut b = self.bucket.lock().unwrap();
                let mut recs = self.records.lock().unwrap();
                let recorded = give_back_recorded(p, &mut b, &mut recs, &acct, tokens, now);
                self.given.lock().unwrap().push(tokens);
                Ok(GiveBackReply {
                    now_us: now,
                    units_left: b.unwrap().tokens,
                    recorded,
                })
            })
        }
    }

    impl Store for Fake {
        fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            let admitted = !self.refuse_checks.load(Ordering::SeqCst);
            CheckFuture::ready(Ok(Outcome {
                admitted,
                now_us: self.now(),
                buckets: batch
                    .iter()
                    .map(|_| BucketVerdict {
                        sufficient: admitted,
                        tokens: 0,
                        wait_us: Some(if admitted { 0 } else { 5_000_000 }),
                    })
                    .collect(),
                source: Source::Store,
                leased: 0,
            }))
        }

        fn kind(&self) -> &'static str {
            "fake"
        }

        fn adjust<'a>(
            &'a self,
            batch: &'a [CheckItem],
            outcome: &'a Outcome,
            units: &'a [i64],
        ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
            assert_eq!(batch.len(), outcome.buckets.len());
            assert_eq!(batch.len(), units.len());
            assert_eq!(outcome.leased, 0, "leased items never reach the store's refund");
            self.refunded
                .lock()
                .unwrap()
                .push(batch.iter().map(|i| i.key.to_string()).collect());
            Box::pin(std::future::ready(Ok(Adjusted::none(batch.len()))))
        }
    }

    fn leases(fake: &Arc<Fake>) -> (Arc<Leases>, Arc<Metrics>) {
        let m = Metrics::new();
        let l = Leases::new(
            fake.clone(),
            fake.clone(),
            Arc::new(FleetSize::fixed(1)),
            m.clone(),
            Duration::from_millis(3),
        );
        (l, m)
    }

    fn item(rate: &str, burst: u64, block: u64, cost: u64) -> CheckItem {
        let params = BucketParams::new(Rate::parse(rate).unwrap(), burst).unwrap();
        let mut i = CheckItem::new(
            "rl:{kbig}:plan".into(),
            Charge {
                params,
                cost,
                shadow: false,
            },
            0,
            FailurePolicy::Local,
        );
        i.lease = Some(LeaseBlock::Fixed(block));
        i
    }

    async fn settle(l: &Leases) {
        while l.calls_in_flight() > 0 {
            tokio::time::sleep(Duration::from_micros(10)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_cold_key_waits_for_its_block_which_goes_back_ten_seconds_after_it_arrived() {
        let fake = Fake::new();
        let (l, m) = leases(&fake);
        let hot = [item("10000/1s", 20_000, 100, 1)];
        assert!(l.check(&hot).await.unwrap().admitted);
        assert_eq!(l.held(), 99);
        assert_eq!(
            fake.checks.load(Ordering::SeqCst),
            0,
            "the first request waited for the lease"
        );
        tokio::time::sleep(Duration::from_micros(BLOCK_TTL_US) - Duration::from_millis(1)).await;
        assert_eq!(l.held(), 99, "expired early");
        tokio::time::sleep(Duration::from_millis(2)).await;
        settle(&l).await;
        assert_eq!(l.held(), 0);
        assert_eq!(*fake.given.lock().unwrap(), vec![99]);
        assert_eq!(m.lease_tokens_returned.get(), 99);
        assert_eq!(m.lease_tokens_held.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_denied_key_is_refused_locally_until_denied_until_without_a_store_call() {
        let fake = Fake::new();
        let (l, m) = leases(&fake);
        // Burst = block: the first block empties the bucket, so the next lease is denied for
        // one cycle, 100 / 1,000 s = 100 ms (plus up to 50 ms of jitter).
        let hot = [item("1000/1s", 100, 100, 1)];
        for i in 0..100 {
            assert!(l.check(&hot).await.unwrap().admitted, "request {i}");
            settle(&l).await;
        }
        assert_eq!((m.lease_grants.get(), m.lease_denials.get()), (1, 1));
        let out = l.check(&hot).await.unwrap();
        assert!(!out.admitted);
        let wait = out.buckets[0].wait_us.unwrap();
        assert!((1..=150_000).contains(&wait), "{wait}");
        // Refusals cost nothing until then.
        for _ in 0..50 {
            assert!(!l.check(&hot).await.unwrap().admitted);
        }
        assert_eq!(fake.leases.load(Ordering::SeqCst), 2);
        assert_eq!(fake.checks.load(Ordering::SeqCst), 0);
        // After the denial the bucket has refilled a block.
        tokio::time::sleep(Duration::from_micros(wait)).await;
        assert!(l.check(&hot).await.unwrap().admitted);
        assert_eq!(m.lease_grants.get(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_gateway_that_spent_its_block_and_fell_silent_syncs_before_its_record_expires() {
        let fake = Fake::new();
        let (l, _m) = leases(&fake);
        // Burst = block: the second lease, at 20 left, is denied, so the last call the store
        // saw reported 80 spent and the record says 20.
        let hot = [item("1000/1s", 100, 100, 1)];
        for _ in 0..100 {
            assert!(l.check(&hot).await.unwrap().admitted);
            settle(&l).await;
        }
        let record = |f: &Fake| f.records.lock().unwrap().get(l.holder_id()).map(|r| r.tokens);
        assert_eq!(record(&fake), Some(20));
        assert_eq!(l.held(), 0);
        // Nothing is left to give back at the block's expiry; 11 s after the last call a
        // give-back of nothing reports the 20 spent, 1 s before the store would reclaim them.
        tokio::time::sleep(Duration::from_micros(SYNC_AFTER_US) - Duration::from_millis(1)).await;
        assert_eq!(record(&fake), Some(20));
        tokio::time::sleep(Duration::from_millis(2)).await;
        settle(&l).await;
        assert_eq!(record(&fake), None);
        assert_eq!(*fake.given.lock().unwrap(), vec![0]);
        // Past the record's own expiry nothing more is sent and nothing is reclaimed.
        tokio::time::sleep(Duration::from_secs(30)).await;
        settle(&l).await;
        assert_eq!(fake.given.lock().unwrap().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_leases_send_the_key_through_the_inner_store_then_leasing_resumes() {
        let fake = Fake::new();
        let (l, m) = leases(&fake);
        let hot = [item("10000/1s", 20_000, 100, 1)];
        fake.fail.store(true, Ordering::SeqCst);
        // The inner store (the guard, with its failure policy) decides meanwhile.
        for _ in 0..20 {
            assert!(l.check(&hot).await.unwrap().admitted);
        }
        assert_eq!(fake.checks.load(Ordering::SeqCst), 20);
        assert_eq!(
            fake.leases.load(Ordering::SeqCst),
            1,
            "one lease a second per key"
        );
        assert_eq!(m.lease_failures.get_or_create(&Kind { kind: "lease" }).get(), 1);
        fake.refuse_checks.store(true, Ordering::SeqCst);
        assert!(
            !l.check(&hot).await.unwrap().admitted,
            "the inner store's limit stands"
        );
        fake.fail.store(false, Ordering::SeqCst);
        fake.refuse_checks.store(false, Ordering::SeqCst);
        tokio::time::sleep(RETRY_AFTER_FAILURE).await;
        assert!(l.check(&hot).await.unwrap().admitted);
        assert_eq!(l.held(), 99);
        assert_eq!(fake.checks.load(Ordering::SeqCst), 21);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_elsewhere_puts_the_reserved_tokens_back() {
        let fake = Fake::new();
        let (l, _m) = leases(&fake);
        let mut other = item("1/1s", 1, 1, 1);
        other.lease = None;
        other.key = "rl:{kbig}:exports".into();
        let hot = item("10000/1s", 20_000, 100, 10);
        assert!(l.check(&[hot.clone(), other.clone()]).await.unwrap().admitted);
        assert_eq!(l.held(), 90);
        fake.refuse_checks.store(true, Ordering::SeqCst);
        let out = l.check(&[hot.clone(), other]).await.unwrap();
        assert!(!out.admitted);
        assert!(out.buckets[0].sufficient && !out.buckets[1].sufficient);
        assert_eq!(l.held(), 90, "the 10 reserved tokens went back to the block");
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_of_cost_zero_neither_leases_nor_spends() {
        let fake = Fake::new();
        let (l, m) = leases(&fake);
        let peek = item("10000/1s", 20_000, 100, 0);
        let scale = peek.charge.params.scale;
        // Nothing held: the store reads the bucket, and no block is asked for.
        let out = l.check(std::slice::from_ref(&peek)).await.unwrap();
        assert!(out.admitted && out.leased == 0);
        settle(&l).await;
        assert_eq!(fake.leases.load(Ordering::SeqCst), 0);
        assert_eq!(fake.checks.load(Ordering::SeqCst), 1);
        // A block held: the peek reads what is left of it and takes none of it.
        let hot = item("10000/1s", 20_000, 100, 1);
        assert!(l.check(std::slice::from_ref(&hot)).await.unwrap().admitted);
        settle(&l).await;
        assert_eq!((l.held(), fake.leases.load(Ordering::SeqCst)), (99, 1));
        let out = l.check(std::slice::from_ref(&peek)).await.unwrap();
        assert!(out.admitted && out.leased == 0);
        assert_eq!(
            out.buckets[0],
            BucketVerdict {
                sufficient: true,
                tokens: 99 * scale,
                wait_us: Some(0),
            }
        );
        // Beside a bucket the store refuses, it still takes nothing, and nothing goes back.
        let mut other = item("1/1s", 1, 1, 1);
        other.lease = None;
        other.key = "rl:{kbig}:exports".into();
        fake.refuse_checks.store(true, Ordering::SeqCst);
        let out = l.check(&[peek.clone(), other]).await.unwrap();
        assert!(!out.admitted && out.leased == 0);
        settle(&l).await;
        assert_eq!(l.held(), 99);
        assert_eq!(fake.leases.load(Ordering::SeqCst), 1);
        assert!(fake.given.lock().unwrap().is_empty());
        assert_eq!(m.lease_tokens_held.get(), 99);
        // Past the block's expiry (its timer gave the rest back) a peek sees nothing held: the
        // store answers, and still no block is asked for.
        tokio::time::sleep(Duration::from_micros(BLOCK_TTL_US)).await;
        fake.refuse_checks.store(false, Ordering::SeqCst);
        let before = fake.checks.load(Ordering::SeqCst);
        assert!(l.check(std::slice::from_ref(&peek)).await.unwrap().admitted);
        assert_eq!(fake.checks.load(Ordering::SeqCst), before + 1);
        assert_eq!(fake.leases.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn drain_gives_back_what_is_held_and_grants_still_on_their_way() {
        let fake = Fake::new();
        let (l, m) = leases(&fake);
        let a = item("10000/1s", 20_000, 100, 1);
        let mut b = item("10000/1s", 20_000, 100, 1);
        b.key = "rl:{other}:plan".into();
        b.fp = crate::fingerprint(&b.key);
        assert!(l.check(std::slice::from_ref(&a)).await.unwrap().admitted);
        // The next lease answers after 50 ms: the request is checked in the store meanwhile,
        // and the grant arrives after the drain began.
        fake.delay_ms.store(50, Ordering::SeqCst);
        assert!(l.check(std::slice::from_ref(&b)).await.unwrap().admitted);
        assert_eq!(fake.checks.load(Ordering::SeqCst), 1);
        assert_eq!(l.drain(Duration::from_secs(1)).await, 99);
        assert_eq!(l.held(), 0);
        assert_eq!(l.calls_in_flight(), 0);
        let mut given = fake.given.lock().unwrap().clone();
        given.sort_unstable();
        assert_eq!(given, vec![99, 100]);
        assert_eq!(m.lease_tokens_returned.get(), 199);
        assert!(
            fake.records.lock().unwrap().is_empty(),
            "a clean exit leaves a record: {:?}",
            fake.records.lock().unwrap()
        );
        // Drained: later requests go to the store, nothing more is leased.
        assert!(l.check(&[a]).await.unwrap().admitted);
        assert_eq!(fake.leases.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_undelivered_request_puts_block_tokens_back_and_refunds_the_rest_in_the_store() {
        let fake = Fake::new();
        let (l, _m) = leases(&fake);
        let mut other = item("1/1s", 1, 1, 1);
        other.lease = None;
        other.key = "rl:{kbig}:exports".into();
        let hot = item("10000/1s", 20_000, 100, 10);
        let batch = [hot.clone(), other];
        let out = l.check(&batch).await.unwrap();
        assert!(out.admitted);
        assert!(out.is_leased(0) && !out.is_leased(1));
        assert_eq!(l.held(), 90);
        let paid = l.check(std::slice::from_ref(&hot)).await.unwrap();
        assert_eq!(l.held(), 80);
        l.refund(&batch, &out).await.unwrap();
        assert_eq!(l.held(), 90, "the block got its 10 tokens back");
        assert_eq!(
            *fake.refunded.lock().unwrap(),
            vec![vec!["rl:{kbig}:exports".to_string()]],
            "the store refunds only what it charged"
        );
        // A request a block paid alone never reaches the store's refund.
        l.refund(std::slice::from_ref(&hot), &paid).await.unwrap();
        assert_eq!(l.held(), 100);
        assert_eq!(fake.refunded.lock().unwrap().len(), 1);
        // A limited request's refund changes nothing.
        fake.refuse_checks.store(true, Ordering::SeqCst);
        let limited = l.check(&batch).await.unwrap();
        assert!(!limited.admitted);
        assert_eq!(l.held(), 100);
        l.refund(&batch, &limited).await.unwrap();
        assert_eq!(l.held(), 100);
    }
}
