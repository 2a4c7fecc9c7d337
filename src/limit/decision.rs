//! A store's answer read as one decision: admitted, limited or unavailable, which bucket
//! decided, the budget left and the wait. The gateway builds headers and the 429 body from it.

use smallvec::SmallVec;

use super::bucket::{BucketParams, BucketVerdict, US_PER_S, retry_after_secs, secs_to_full};
use crate::batch::{CheckItem, FailurePolicy, Outcome, Source};

/// What the limiter decided for one request, in the words the gateway uses everywhere (code,
/// metrics, logs, README): **admitted**, **limited** (429, with the wait), or **unavailable**
/// (503: the store could not decide and a limit's failure policy refuses rather than guess).
/// Shadow limits never decide; what they would have limited is in the report.
///
/// A store's answer for one request of two buckets, read by [`decide`]: the short bucket
/// decides, and its wait is the `Retry-After`.
///
/// ```
/// use tollgate_limit::batch::{CheckItem, FailurePolicy, Outcome, Source};
/// use tollgate_limit::bucket::{BucketParams, BucketVerdict, Charge, Rate};
/// use tollgate_limit::decision::{Wait, decide};
///
/// let charge = |burst| Charge {
///     params: BucketParams::new(Rate::parse("1/1s").unwrap(), burst).unwrap(),
///     cost: 1,
///     shadow: false,
/// };
/// let batch = [
///     CheckItem::new("rl:{k7}:plan".into(), charge(100), 0, FailurePolicy::Local),
///     CheckItem::new("rl:{k7}:route:exports".into(), charge(3), 1, FailurePolicy::Local),
/// ];
/// let scale = batch[0].charge.params.scale;
/// let verdict = |sufficient, tokens, wait_us| BucketVerdict {
///     sufficient,
///     tokens,
///     wait_us: Some(wait_us),
///     blocked: false,
/// };
/// let outcome = Outcome {
///     admitted: false,
///     now_us: 0,
///     // The plan holds 40 tokens; the exports bucket is empty, a token 2.5 s away.
///     buckets: [verdict(true, 40 * scale, 0), verdict(false, 0, 2_500_000)].into_iter().collect(),
///     source: Source::Store,
///     leased: 0,
/// };
///
/// let d = decide(&batch, &outcome);
/// assert!(!d.admitted());
/// assert_eq!(d.deciding, Some(1));
/// assert_eq!(d.remaining, 0);
/// assert!(matches!(d, tollgate_limit::decision::Decision::Limited(_, Wait::Secs(3))));
/// assert_eq!(d.retry_after(), Some(3));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Admitted(Report),
    Limited(Report, Wait),
    Unavailable(Report),
}

/// How long a limited request should wait before it can pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Whole seconds, for `Retry-After`.
    Secs(u64),
    /// Never: its cost is above the bucket's burst.
    Never,
}

/// What every decision reports: the deciding bucket and its budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// Index into the batch of the bucket that decided: the short bucket with the longest wait
    /// for a limited request, the bucket with the fewest whole tokens left for an admission. `None`
    /// when the request paid no enforced bucket.
    pub deciding: Option<usize>,
    /// Whole tokens left in the deciding bucket.
    pub remaining: u64,
    /// `t` of the `RateLimit` field.
    pub reset_secs: u64,
    /// Limits in shadow mode that would have limited this request.
    pub shadow_refusals: SmallVec<[u16; 2]>,
    /// Who decided: the store, or a failure policy in its place.
    pub source: Source,
    /// How long an admitted request waits for its tokens before it goes on: the longest wait
    /// of its queueing limits' buckets (`"delay"`), 0 when every bucket paid at once.
    pub delay_us: u64,
    /// The deciding bucket is blocked (`"block_for"`): it was already, or this refusal started
    /// its block.
    pub blocked: bool,
}

impl Decision {
    pub fn admitted(&self) -> bool {
        matches!(self, Decision::Admitted(_))
    }

    /// Seconds for `Retry-After`: `None` when admitted, or when no wait helps.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            Decision::Limited(_, Wait::Secs(s)) => Some(*s),
            _ => None,
        }
    }
}

impl std::ops::Deref for Decision {
    type Target = Report;

    fn deref(&self) -> &Report {
        match self {
            Decision::Admitted(r) | Decision::Limited(r, _) | Decision::Unavailable(r) => r,
        }
    }
}

/// Reads an outcome against its batch.
pub fn decide(batch: &[CheckItem], outcome: &Outcome) -> Decision {
    let mut deciding: Option<usize> = None;
    let mut shadow_refusals = SmallVec::new();
    let mut delay_us = 0;
    // What a refused bucket's wait means to its client: a queueing limit refuses a request
    // whose wait is longer than its longest, so it passes once the rest is waited out.
    // A block's wait is the block's, and a blocking limit's refusal starts a whole one.
    let wait = |item: &CheckItem, v: &BucketVerdict| {
        let p = &item.charge.params;
        match (v.blocked, p.block_us) {
            (true, _) => v.wait_us,
            (false, b) if b > 0 && !v.sufficient => Some(b),
            _ => v.wait_us.map(|w| w.saturating_sub(p.max_wait_us)),
        }
    };
    for (i, (item, v)) in batch.iter().zip(&outcome.buckets).enumerate() {
        if item.charge.shadow {
            if !v.sufficient {
                shadow_refusals.push(item.limit);
            }
            continue;
        }
        if outcome.admitted && v.sufficient {
            delay_us = delay_us.max(v.wait_us.unwrap_or(0));
        }
        let better = match deciding {
            None => outcome.admitted || !v.sufficient,
            Some(d) => {
                let cur = &outcome.buckets[d];
                if outcome.admitted {
                    v.remaining(&item.charge.params) < cur.remaining(&batch[d].charge.params)
                } else if v.sufficient {
                    false
                } else {
                    // The longest wait decides; "never" is longest of all.
                    match (wait(item, v), wait(&batch[d], cur)) {
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
            if outcome.admitted {
                // A queued request's bucket is empty until its tokens are due, and fills after.
                let owed = v.wait_us.unwrap_or(0);
                let reset = if owed == 0 {
                    secs_to_full(p, v.tokens)
                } else {
                    (p.fill_time_us() + owed).div_ceil(US_PER_S)
                };
                (v.remaining(p), None, reset)
            } else {
                let retry = wait(&batch[d], v).map(retry_after_secs);
                (v.remaining(p), retry, retry.unwrap_or(0))
            }
        }
    };
    let report = Report {
        deciding,
        remaining,
        reset_secs,
        shadow_refusals,
        source: outcome.source,
        delay_us: if outcome.admitted { delay_us } else { 0 },
        blocked: !outcome.admitted
            && deciding.is_some_and(|d| outcome.buckets[d].blocked || batch[d].charge.params.block_us > 0),
    };
    match (outcome.admitted, outcome.source) {
        (true, _) => Decision::Admitted(report),
        // Turned away by a failure policy, not by a bucket: the client did nothing wrong.
        (false, Source::Bypass(FailurePolicy::Closed)) => Decision::Unavailable(report),
        (false, _) => Decision::Limited(report, retry_after.map_or(Wait::Never, Wait::Secs)),
    }
}
