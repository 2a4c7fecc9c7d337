//! A usage route's answer (`"serve": "usage"`): the caller's own budget, in place of admission
//! and forwarding. One store call charges the route's own cost and reads every other bucket of
//! the caller's key at cost 0, so each reads as the `RateLimit` field of a request paying it
//! would report it, and nothing it reads is charged, even when its own cost is refused.

use tollgate_limit::decision::Decision;
use tollgate_rules::{Snapshot, plan};
use tollgate_store::Outcome;

use super::Gateway;
use crate::request::{Begun, Classified, deciding_name, rate_limited, with_budget};
use crate::respond::{Answer, QuotaHeaders, RateFields, Refusal};

use crate::respond::{Usage, UsageLimit, UsageQuota, budget_values, quota_used};
use tollgate_limit::bucket::secs_to_full;

impl Gateway {
    /// The step a usage route takes instead of `admit` and `forward`, on either wire. The route's
    /// own cost refuses as any route's does (seats, 429, 503); the answer carries its
    /// `RateLimit` fields as any admitted request's. A key's quota neither refuses it nor
    /// counts it: it forwards nothing, so it is not metered.
    pub(crate) async fn usage(
        &self,
        b: &mut Begun<'_>,
        c: Classified,
        headers: &http::HeaderMap,
        body_value: Option<&[u8]>,
    ) -> Answer {
        let (snap, live, facts) = (&*b.snap, &*b.live, &mut b.facts);
        let route = &snap.routes[c.route];
        let Some((k, _)) = c.key else {
            // The rules let a usage route only require a key, which `identify` has checked.
            return Refusal::Unauthorized {
                reason: "missing_key",
                message: "this route needs an API key (Authorization: Bearer or X-API-Key)",
            }
            .into();
        };
        let key = &snap.keys[k];
        let (quota, quota_fields) = match &key.quota {
            None => (None, None),
            Some(q) => {
                let now_ms = (self.clock.now_us() / 1000) as i64;
                let flags = self.quota_flags.load();
                let flag = flags.get(&*key.id);
                let period = q.period(now_ms);
                let used = quota_used(&period, flag, now_ms).min(q.limit);
                let fields = QuotaHeaders::new(q, &period, flag, now_ms);
                let body = UsageQuota {
                    per: q.per.as_str(),
                    limit: q.limit,
                    used,
                    remaining: q.limit - used,
                    resets_at: period.resets_at,
                };
                (Some(body), Some(Box::new(fields)))
            }
        };
        let with_quota = |mut a: Answer| {
            a.fields.quota.clone_from(&quota_fields);
            a
        };
        let caller = c.caller();
        // Held while the answer is made, like any request's, and given back as it drops.
        let _seats = if route
            .costs
            .iter()
            .any(|&(li, _)| snap.limits[li as usize].concurrent.is_some())
        {
            match self.take_seats(snap, route, k, facts).await {
                Ok(s) => s,
                Err(a) => return with_quota(a),
            }
        } else {
            Vec::new()
        };
        let mut batch = match plan::build_for(snap, route, caller, c.ip, c.fingerprint, headers, body_value) {
            Ok(b) => b,
            Err(e) => return with_quota(Refusal::BadRequest(e.to_string()).into()),
        };
        let paying = batch.len();
        batch.extend(plan::key_peeks(snap, route, k, c.ip));
        if let Some(r) = &self.regions {
            r.apply(snap, Some(k), &mut batch);
        }
        let checked = if batch.is_empty() {
            None
        } else {
            match self.check(snap, &live.handles, &batch, paying, facts).await {
                Ok(checked) => Some(checked),
                Err(e) => {
                    tracing::warn!(error = %e, "limiter store failed");
                    return with_quota(Refusal::LimiterUnavailable.into());
                }
            }
        };
        let paid = &batch[..paying];
        let mut budget = None;
        let mut limits = Vec::new();
        if let Some((d, outcome)) = &checked {
            facts.limit = deciding_name(snap, paid, d);
            match d {
                Decision::Admitted(_) => {}
                Decision::Unavailable(_) => return with_quota(Refusal::LimiterUnavailable.into()),
                Decision::Limited(..) => {
                    let refusal =
                        with_budget(rate_limited(snap, paid, d), budget_values(snap, paid, caller, d));
                    return with_quota(refusal);
                }
            }
            budget = budget_values(snap, paid, caller, d);
            limits = key_limits(snap, k, &batch, outcome);
        }
        facts.admitted = true;
        let mut a = Answer::from(Refusal::Usage(Box::new(Usage {
            key: key.id.to_string(),
            tenant: key.tenant.to_string(),
            limits,
            quota,
        })));
        a.fields = RateFields {
            budget,
            quota: quota_fields,
        };
        a
    }
}

/// The key's own buckets in a checked batch, in limit order: each enforced `"key"` limit, with
/// the key's numbers as written and, from its verdict, the `r` and `t` its `RateLimit` member
/// would carry (as `decide` computes them for an admitted request).
fn key_limits(
    snap: &Snapshot,
    k: usize,
    batch: &[tollgate_store::CheckItem],
    outcome: &Outcome,
) -> Vec<UsageLimit> {
    let mut read: Vec<(u16, UsageLimit)> = batch
        .iter()
        .zip(&outcome.buckets)
        .filter_map(|(item, v)| {
            let li = item.limit as usize;
            let limit = &snap.limits[li];
            if limit.dimension != tollgate_rules::Dimension::Key || limit.shadow() {
                return None;
            }
            let numbers = snap.keys.numbers(k, limit, li)?;
            let p = &item.charge.params;
            Some((
                item.limit,
                UsageLimit {
                    name: limit.name.to_string(),
                    rate: numbers.params.rate.to_string(),
                    burst: numbers.params.burst,
                    remaining: v.remaining(p),
                    reset_s: secs_to_full(p, v.tokens),
                },
            ))
        })
        .collect();
    read.sort_by_key(|(li, _)| *li);
    read.into_iter().map(|(_, l)| l).collect()
}
