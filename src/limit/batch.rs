//! What one request asks of the limiter and what it gets back, as plain values: the buckets of
//! one all-or-nothing check ([`CheckItem`], [`Batch`]), each limit's [`FailurePolicy`], and the
//! store's answer ([`Outcome`]). Every store takes and gives these; nothing here does I/O.

use std::hash::BuildHasher;
use std::sync::{Arc, LazyLock};

use smallvec::SmallVec;

use crate::bucket::{BucketVerdict, Charge};

/// Block size for leased limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseBlock {
    Auto,
    Fixed(u64),
}

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
    pub admitted: bool,
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

    /// The part of this outcome that answers the items at `places` of its batch, in that
    /// order: what a store needs to refund only those items.
    pub fn part(&self, places: &[usize]) -> Outcome {
        let mut leased = 0u64;
        for (j, &place) in places.iter().enumerate() {
            if self.is_leased(place) && j < 64 {
                leased |= 1 << j;
            }
        }
        Outcome {
            admitted: self.admitted,
            now_us: self.now_us,
            buckets: places.iter().map(|&p| self.buckets[p]).collect(),
            source: self.source,
            leased,
        }
    }
}

/// Per-process random keys, so nobody outside can craft two bucket names with one fingerprint.
static FINGERPRINT: LazyLock<std::collections::hash_map::RandomState> =
    LazyLock::new(std::collections::hash_map::RandomState::new);

/// The embedded store's 64-bit name for a bucket. Two live buckets share one with probability
/// about n²/2⁶⁵ (3·10⁻⁸ at a million keys); the keys are random per process.
#[inline]
pub fn fingerprint(key: &str) -> u64 {
    FINGERPRINT.hash_one(key)
}
