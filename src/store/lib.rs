//! The limiter's state behind one trait: every bucket of a request goes in one all-or-nothing call.
//!
//! [`MemoryStore`](memory::MemoryStore) is the embedded default. [`RedisStore`](redis::RedisStore)
//! runs the same arithmetic inside one Lua script (`lua/check.lua`) on the store's clock. Both pass one conformance suite
//! (`tests/store_conformance.rs`).
//!
//! A request that was admitted but could not be delivered (the upstream refused the connection,
//! the write failed) is refunded with [`Store::refund`]: one all-or-nothing step that gives each
//! bucket back exactly what its check took, so it holds what it would hold had the request never
//! been checked. A post-paid limit's bucket is charged what the upstream reported with
//! [`Store::adjust`], the same step with the units given: taken, down to the limit's debt floor.
//! The caller keeps the batch and the [`Outcome`] of the check for either.
//!
//! On Redis Cluster a request whose buckets lie in several hash slots is checked slot by slot
//! by [`Slots`](slots::Slots), in front of the guard; every other request is one call.

pub mod guard;
pub mod lease;
pub mod memory;
mod nodes;
pub mod page;
pub mod redis;
pub mod seats;
pub mod slots;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use smallvec::SmallVec;

pub use tollgate_limit::batch::{Batch, CheckItem, FailurePolicy, LeaseBlock, Outcome, Source, fingerprint};

/// A real failure to get an answer. A limited request is an [`Outcome`], never an error.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    #[error("limiter store unavailable: {0}")]
    Unavailable(String),
    #[error("limiter store timed out")]
    Timeout,
    #[error("limiter store answered something unexpected: {0}")]
    Protocol(String),
    #[error("limiter store breaker is open")]
    BreakerOpen,
}

/// The future of one check: ready at once for the embedded store (no allocation on the hot
/// path), boxed for stores that go over the network.
pub enum CheckFuture<'a> {
    Ready(Option<Result<Outcome, StoreError>>),
    Boxed(Pin<Box<dyn Future<Output = Result<Outcome, StoreError>> + Send + 'a>>),
}

impl CheckFuture<'_> {
    pub fn ready(r: Result<Outcome, StoreError>) -> Self {
        CheckFuture::Ready(Some(r))
    }
}

impl Future for CheckFuture<'_> {
    type Output = Result<Outcome, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            CheckFuture::Ready(r) => Poll::Ready(
                r.take()
                    .unwrap_or_else(|| Err(StoreError::Protocol("check polled after it completed".into()))),
            ),
            CheckFuture::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

/// Holds every bucket. Implementations must check a batch all-or-nothing and atomically with
/// respect to other checks of the same buckets.
pub trait Store: Send + Sync + 'static {
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a>;

    /// A short name for logs and metrics: `memory`, `redis`, `redis-cluster`.
    fn kind(&self) -> &'static str;

    /// Whether the store answers now (for `/readyz`).
    fn ping(&self) -> CheckFuture<'_> {
        CheckFuture::ready(Ok(Outcome {
            admitted: true,
            now_us: 0,
            buckets: SmallVec::new(),
            source: Source::Store,
            leased: 0,
        }))
    }

    /// Gives back, in one all-or-nothing step, what the check that answered `outcome` took from
    /// `batch`'s buckets, for an admitted request that could not be delivered. Each bucket it
    /// charged gets its cost back (in the bucket's units, `cost × scale`), added to the bucket as
    /// refilled to the store's now and never above its burst: it then holds what it would hold
    /// had the request never been checked. Shadow buckets the check charged are refunded too (the
    /// request never happened, so a shadow limit must not count it). A limited outcome took
    /// nothing from its enforced buckets and its refund changes nothing.
    ///
    /// `batch` must be the one that was checked, in the same order; `outcome` says which buckets
    /// were charged (`sufficient`), where the answer came from (`source`: a guard refunds a
    /// bypass into its local share, or not at all) and which items a leased block paid
    /// (`leased`). Call it at most once per outcome: a second call gives the cost back again
    /// (still capped at the burst). A remote store sends it at most once and never retries: a
    /// refund whose answer was lost may have been applied.
    fn refund<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            if batch.len() != outcome.buckets.len() {
                return Err(mismatch(batch, outcome));
            }
            let units = refund_units(batch, outcome);
            if units.iter().all(|u| *u == 0) {
                return Ok(());
            }
            self.adjust(batch, outcome, &units).await.map(|_| ())
        })
    }

    /// Adds `units[i]` to the bucket of `batch[i]` (takes them when below zero), in one
    /// all-or-nothing step, after the check that answered `outcome`: each bucket refilled to the
    /// store's now, then kept between its debt floor (`BucketParams::debt`, 0 but for post-paid
    /// limits) and its burst. Buckets whose units are 0 are left alone. A refund is this with
    /// each charged bucket's cost; a post-paid debit, with what the answer cost beyond the
    /// reserve. Routed as the check was (`source`, `leased`), sent at most once, never retried.
    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>>;

    /// Marks this gateway alive in the fleet and returns how many gateways are alive, for
    /// local shares (r/N). Stores that no other gateway shares return `None`.
    fn heartbeat<'a>(&'a self, _instance: &'a str) -> BoxFuture<'a, Result<Option<u32>, StoreError>> {
        Box::pin(std::future::ready(Ok(None)))
    }

    /// Whether a check can fail at all (a store on the network); only those need a guard.
    fn remote(&self) -> bool {
        false
    }

    /// The blocks of `block_for` limits in force now: each blocked bucket's name and the
    /// microsecond its block ends, on the store's clock.
    fn blocks(&self) -> BoxFuture<'_, Result<Blocks, StoreError>> {
        Box::pin(std::future::ready(Ok(Blocks::default())))
    }

    /// Lifts the block of the bucket named `bucket`; false when it had none in force.
    fn lift<'a>(&'a self, _bucket: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(std::future::ready(Ok(false)))
    }
}

/// What [`Store::blocks`] found: the store's now and each block in force, by bucket name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Blocks {
    pub now_us: u64,
    pub list: Vec<(String, u64)>,
}

/// What [`Store::adjust`] left: each bucket's balance in units (below zero, the units it owes),
/// or `None` for one it left alone or whose change reached no store (a bypassed check).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Adjusted {
    pub now_us: u64,
    pub balances: SmallVec<[Option<i64>; 4]>,
}

impl Adjusted {
    /// Nothing changed anywhere.
    pub fn none(n: usize) -> Adjusted {
        Adjusted {
            now_us: 0,
            balances: SmallVec::from_elem(None, n),
        }
    }
}

/// What a refund gives each item of `batch`: the units its check took from the buckets it
/// charged (the shadow ones included), 0 for the rest; all 0 for a limited request.
pub fn refund_units(batch: &[CheckItem], outcome: &Outcome) -> SmallVec<[i64; 4]> {
    batch
        .iter()
        .zip(&outcome.buckets)
        .map(|(i, v)| {
            if outcome.admitted && tollgate_limit::bucket::charged(&i.charge, v, true) {
                // A check never charges more than the capacity, which is below 2^53.
                i.charge.params.units(i.charge.cost).min(i.charge.params.capacity) as i64
            } else {
                0
            }
        })
        .collect()
}

/// The error for a change whose outcome or units do not belong to its batch.
pub(crate) fn units_mismatch(batch: &[CheckItem], outcome: &Outcome, units: &[i64]) -> Option<StoreError> {
    (batch.len() != outcome.buckets.len() || batch.len() != units.len()).then(|| {
        StoreError::Protocol(format!(
            "a change of {} buckets with an outcome of {} and {} amounts",
            batch.len(),
            outcome.buckets.len(),
            units.len()
        ))
    })
}

/// The error for a refund whose outcome does not belong to its batch.
pub(crate) fn mismatch(batch: &[CheckItem], outcome: &Outcome) -> StoreError {
    StoreError::Protocol(format!(
        "refund of {} buckets with an outcome of {}",
        batch.len(),
        outcome.buckets.len()
    ))
}

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
