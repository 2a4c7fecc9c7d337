//! The limiter's state behind one trait: every bucket of a request goes in one all-or-nothing call.
//!
//! [`MemoryStore`](memory::MemoryStore) is the embedded default. [`RedisStore`](redis::RedisStore)
//! runs the same arithmetic inside one Lua script (`lua/check.lua`) on the store's clock. Both pass one conformance suite
//! (`tests/store_conformance.rs`).
//!
//! A request that was admitted but could not be delivered (the upstream refused the connection,
//! the write failed) is refunded with [`Store::refund`]: one all-or-nothing step that gives each
//! bucket back exactly what its check took, so it holds what it would hold had the request never
//! been checked. The caller keeps the batch and the [`Outcome`] of the check for it.

pub mod guard;
pub mod lease;
pub mod memory;
pub mod redis;

use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};

use smallvec::SmallVec;

use crate::limit::bucket::{BucketVerdict, Charge};
use crate::rules::LeaseBlock;

/// What a limit does when its store can't answer. Chosen per limit, in the rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailurePolicy {
    /// A share of the limit (rate r/N, burst max(1, b/N)) in this gateway's memory.
    Local,
    /// Admit, and count the bypass.
    Open,
    /// Refuse with 503.
    Closed,
}

/// One bucket of one request.
#[derive(Clone, Debug)]
pub struct CheckItem {
    /// The bucket's name in the store, e.g. `rl:{k7}:plan`. Never holds a rule version.
    pub key: Arc<str>,
    /// A 64-bit keyed hash of `key`, so the embedded store never hashes or keeps the string.
    pub fp: u64,
    pub charge: Charge,
    /// Index of the limit in the rules snapshot that produced this item.
    pub limit: u16,
    pub policy: FailurePolicy,
    /// Spent from leased blocks in the gateway's memory when the store is remote (hot keys,
    /// `store::lease`); the embedded store checks it like any other bucket.
    pub lease: Option<LeaseBlock>,
}

impl CheckItem {
    pub fn new(key: Arc<str>, charge: Charge, limit: u16, policy: FailurePolicy) -> CheckItem {
        CheckItem {
            fp: fingerprint(&key),
            key,
            charge,
            limit,
            policy,
            lease: None,
        }
    }
}

/// Every bucket of one request. Four inline slots cover the demo's largest request.
pub type Batch = SmallVec<[CheckItem; 4]>;

/// Where a bucket's answer came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The store's shared bucket.
    Store,
    /// Decided without the store, under this failure policy.
    Bypass(FailurePolicy),
}

/// The store's answer to one batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Every enforced bucket held its cost, and all of them were charged.
    pub allowed: bool,
    /// The time the check used, in microseconds (the store's clock for Redis).
    pub now_us: u64,
    /// One verdict per item, in batch order.
    pub buckets: SmallVec<[BucketVerdict; 4]>,
    pub source: Source,
    /// Bit `i` set: item `i` was paid from a block this gateway leased (`store::lease`), not by
    /// the store, so its refund goes back to the block. Only the first 64 items are ever leased.
    pub leased: u64,
}

impl Outcome {
    /// Whether item `i` of the batch was paid from a leased block.
    pub fn is_leased(&self, i: usize) -> bool {
        i < 64 && self.leased & (1 << i) != 0
    }
}

/// A real failure to get an answer. A refusal is an [`Outcome`], never an error.
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
            allowed: true,
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
    /// request never happened, so a shadow limit must not count it). A refused outcome took
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
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Marks this gateway alive in the fleet and returns how many gateways are alive, for
    /// local shares (r/N). Stores that no other gateway shares return `None`.
    fn heartbeat<'a>(&'a self, _instance: &'a str) -> BoxFuture<'a, Result<Option<u32>, StoreError>> {
        Box::pin(std::future::ready(Ok(None)))
    }

    /// Whether a check can fail at all (a store on the network); only those need a guard.
    fn remote(&self) -> bool {
        false
    }
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

/// Per-process random keys, so nobody outside can craft two bucket names with one fingerprint.
static FINGERPRINT: LazyLock<std::collections::hash_map::RandomState> =
    LazyLock::new(std::collections::hash_map::RandomState::new);

/// The embedded store's 64-bit name for a bucket. Two live buckets share one with probability
/// about n²/2⁶⁵ (3·10⁻⁸ at a million keys); the keys are random per process.
#[inline]
pub fn fingerprint(key: &str) -> u64 {
    FINGERPRINT.hash_one(key)
}
