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
//! it holds ([`HolderRecords`](tollgate_limit::lease::HolderRecords)): this gateway has a
//! holder id of its own, and every lease and give-back reports the tokens it spent from that
//! key's blocks since its previous call. A record expires 12 s after the gateway's last
//! call, when the store puts its tokens back; so that a live gateway's never does, one that has
//! spent since its last call and has nothing else to send sends a give-back of nothing 11 s after
//! it (a sync). A call that fails counts what it carried as spent, so the record can only come
//! out low (an undershoot, as a lost give-back is), never high.
//!
//! - `spend`: a request's leased items, paid from blocks or refused locally, and the tokens
//!   put back when the request is refused or undelivered.
//! - `calls`: the lease and give-back calls behind them, off the request path: answers,
//!   block expiry, syncs and the drain.

mod calls;
mod spend;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::guard::FleetSize;
use super::{Adjusted, BoxFuture, CheckFuture, CheckItem, Outcome, Store, StoreError};
use tollgate_limit::batch::LeaseBlock;
use tollgate_limit::bucket::BucketParams;
use tollgate_limit::lease::{Account, BLOCK_TTL_US, Grant, Holder, RECORD_GRACE_US, Recorded, auto_block};
use tollgate_telemetry::logsample::Sampler;
use tollgate_telemetry::metrics::Metrics;

/// A lease call that has not answered in this long counts as failed. Longer than a check's
/// budget: it runs off the request path, and a late grant is still tokens to spend.
pub(crate) const LEASE_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// After a failed lease call, the key is checked through the guard, and no lease is sent for
/// it, for this long.
pub const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(1);

/// A key with spending its store record does not know and no call for this long gets a sync:
/// after the block TTL, so the give-back of a block leased by that last call (whose answer
/// took at most [`LEASE_CALL_TIMEOUT`]) goes first and carries it; and half the record's grace
/// before the store's record of this gateway expires.
pub const SYNC_AFTER_US: u64 = BLOCK_TTL_US + RECORD_GRACE_US / 2;

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
}

impl Store for Leases {
    fn blocks(&self) -> BoxFuture<'_, Result<crate::Blocks, StoreError>> {
        self.inner.blocks()
    }

    fn lift<'a>(&'a self, bucket: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.lift(bucket)
    }

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
        Box::pin(self.adjust_leased(batch, outcome, units))
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
