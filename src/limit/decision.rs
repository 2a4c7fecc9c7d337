//! A store's answer read as one decision: allowed or refused, which bucket decided, the budget
//! left and the wait. Headers and the 429 body are built from it in `crate::respond`.

use smallvec::SmallVec;

use super::bucket::{BucketParams, retry_after_secs};
use super::headers::secs_to_full;
use crate::rules::Snapshot;
use crate::store::{CheckItem, Outcome, Source};

/// What the limiter decided for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// Index into the batch of the bucket that decided: the short bucket with the longest wait
    /// for a refusal, the bucket with the fewest whole tokens left for an admission. `None`
    /// when the request paid no enforced bucket.
    pub deciding: Option<usize>,
    /// Whole tokens left in the deciding bucket.
    pub remaining: u64,
    /// Seconds for `Retry-After` on a refusal; `None` when no wait helps (cost above burst).
    pub retry_after: Option<u64>,
    /// `t` of the `RateLimit` field.
    pub reset_secs: u64,
    /// Limits in shadow mode that would have refused this request.
    pub shadow_refusals: SmallVec<[u16; 2]>,
    pub source: Source,
}

/// Reads an outcome against its batch.
pub fn decide(batch: &[CheckItem], outcome: &Outcome) -> Decision {
    let mut deciding: Option<usize> = None;
    let mut shadow_refusals = SmallVec::new();
    for (i, (item, v)) in batch.iter().zip(&outcome.buckets).enumerate() {
        if item.charge.shadow {
            if !v.sufficient {
                shadow_refusals.push(item.limit);
            }
            continue;
        }
        let better = match deciding {
            None => outcome.allowed || !v.sufficient,
            Some(d) => {
                let cur = &outcome.buckets[d];
                if outcome.allowed {
                    v.remaining(&item.charge.params) < cur.remaining(&batch[d].charge.params)
                } else if v.sufficient {
                    false
                } else {
                    // The longest wait decides; "never" is longest of all.
                    match (v.wait_us, cur.wait_us) {
                        (None, Some(_)) => true,
                        (Some(a), Some(b)) => a > b,
                        _ => false,
                    }
                }
            }
        };
        if better {
            deciding = Some(i);
        }
    }
    let (remaining, retry_after, reset_secs) = match deciding {
        None => (0, None, 0),
        Some(d) => {
            let v = &outcome.buckets[d];
            let p: &BucketParams = &batch[d].charge.params;
            if outcome.allowed {
                (v.remaining(p), None, secs_to_full(p, v.tokens))
            } else {
                let retry = v.wait_us.map(retry_after_secs);
                (v.remaining(p), retry, retry.unwrap_or(0))
            }
        }
    };
    Decision {
        allowed: outcome.allowed,
        deciding,
        remaining,
        retry_after,
        reset_secs,
        shadow_refusals,
        source: outcome.source,
    }
}

/// The limit name of the deciding bucket.
pub fn deciding_limit<'a>(snap: &'a Snapshot, batch: &[CheckItem], d: &Decision) -> Option<&'a str> {
    d.deciding.map(|i| &*snap.limits[batch[i].limit as usize].name)
}
