//! Admission: the request's buckets checked in one step against the store, its seats of
//! limits on requests in flight, its place under the upstream's limit and its key's quota; a
//! [`Forward`] when it may go on, a refusal with its budget when not.

use std::sync::Arc;
use std::time::Instant;

use tollgate_limit::batch::FailurePolicy;
use tollgate_limit::decision::{Decision, decide};
use tollgate_rules::quota::Quota;
use tollgate_rules::{Snapshot, plan};
use tollgate_store::seats::{Seat, Seats, Taken};
use tollgate_store::{Batch, Outcome, StoreError};
use tollgate_telemetry::metrics::Handles;

use super::Gateway;
use super::begin::Facts;
use crate::concurrency::Place;
use crate::request::{Begun, Classified, LiveUpstream};
use crate::respond::{Answer, Budget, QuotaHeaders, RateFields, Refusal};

/// What a request paid to the limiter: every bucket of its one check and the store's answer,
/// kept so a request that is never delivered can be given its charge back.
pub struct Paid {
    pub(super) batch: Batch,
    pub(super) outcome: Outcome,
}

/// The limiter's verdict on an admitted request: its budget headers and what it paid (nothing
/// when no limit applies).
#[derive(Default)]
pub(super) struct Charged {
    pub(super) budget: Option<Budget>,
    pub(super) paid: Option<Box<Paid>>,
    pub(super) seats: Vec<Seat>,
    /// How long it waits for its tokens (a queueing limit's), in microseconds.
    pub(super) delay_us: u64,
}

/// An admitted request on its way upstream.
pub(crate) struct Forward {
    pub upstream: usize,
    /// Its `RateLimit-Policy` and `RateLimit`: the deciding bucket's budget (after a post-paid
    /// debit, the bucket's then) and the key's quota.
    pub fields: RateFields,
    /// What it paid, given back if it never reaches the upstream.
    pub paid: Option<Box<Paid>>,
    /// Its seats of limits on requests in flight, given back when they are dropped: the lane
    /// drops them when the answer is relayed, hyper's path hands them to the answer's body.
    pub seats: Vec<Seat>,
    pub(super) classified: Classified,
    /// The upstream's in-flight place, held until the response body is done (hyper's path
    /// moves it into the body). Taken after a queued request's wait.
    pub place: Option<Place>,
    /// Microseconds a queued request waits for its tokens before it goes on; 0 for most.
    pub delay_us: u64,
}

/// The most of a body read to find a limit's JSON field.
pub(crate) const MAX_FIELD_BODY: u64 = 16 * 1024;

/// The access line's `limit` for a request refused by its quota.
pub(super) static QUOTA: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("(quota)"));

pub(super) static NO_ROUTE: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("(none)"));

pub(super) static OVERLOADED: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| Arc::from("(upstream overloaded)"));

pub(super) fn declared_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// The value of a top-level field of a JSON body, as bucket-name bytes.
pub(super) fn body_field(body: &[u8], field: &str) -> Result<Vec<u8>, String> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| format!("the body must be a JSON object with {field:?}: {e}"))?;
    match v.get(field) {
        Some(serde_json::Value::String(s)) if !s.is_empty() => Ok(s.as_bytes().to_vec()),
        Some(serde_json::Value::Number(n)) => Ok(n.to_string().into_bytes()),
        _ => Err(format!("the JSON body needs a non-empty string field {field:?}")),
    }
}

/// Counts a request in flight until it is answered or its client goes away.
pub(super) struct InFlight<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl<'a> InFlight<'a> {
    pub(super) fn new(g: &'a prometheus_client::metrics::gauge::Gauge) -> Self {
        g.inc();
        InFlight(g)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

pub(super) fn deciding_name(
    snap: &Snapshot,
    batch: &[tollgate_store::CheckItem],
    d: &Decision,
) -> Option<Arc<str>> {
    d.deciding
        .map(|i| snap.limits[batch[i].limit as usize].name.clone())
}

pub(super) fn rate_limited(snap: &Snapshot, batch: &[tollgate_store::CheckItem], d: &Decision) -> Refusal {
    let limit = deciding_name(snap, batch, d)
        .map(|n| n.to_string())
        .unwrap_or_default();
    Refusal::RateLimited {
        limit,
        retry_after: d.retry_after(),
        blocked: d.blocked,
    }
}

/// A refusal with the `RateLimit` fields of the bucket that decided it.
pub(super) fn with_budget(refusal: Refusal, budget: Option<Budget>) -> Answer {
    let mut a = Answer::from(refusal);
    a.fields.budget = budget;
    a
}

impl Gateway {
    /// The second step: one store check for every bucket the request pays (`body_value` is
    /// the JSON field a limit keys on, when its route has one), then a place under the
    /// upstream's `max_in_flight`; the request's target is pointed at its upstream.
    pub(crate) async fn admit(
        &self,
        b: &mut Begun<'_>,
        c: Classified,
        parts: &mut http::request::Parts,
        body_value: Option<&[u8]>,
    ) -> Result<Forward, Answer> {
        let (snap, live, facts) = (&*b.snap, &*b.live, &mut b.facts);
        let route = &snap.routes[c.route];
        let quota = match c
            .key
            .and_then(|(k, _)| snap.keys[k].quota.as_ref().map(|q| (k, q)))
        {
            Some((k, q)) => Some(Box::new(self.quota(snap, k, q, facts).map_err(|r| *r)?)),
            None => None,
        };
        let with_quota = |mut a: Answer| {
            a.fields.quota.clone_from(&quota);
            a
        };
        let Charged {
            budget,
            paid,
            seats,
            delay_us,
        } = self
            .limit(snap, route, &c, &parts.headers, body_value, &live.handles, facts)
            .await
            .map_err(with_quota)?;
        let tollgate_rules::Serves::Upstream(up) = route.serves else {
            // The driver answers a usage route before admission: nothing to forward to.
            return Err(Refusal::NotFound.into());
        };
        let upstream = &snap.upstreams[up];
        // A queued request takes its place after its wait: waiting, it holds none.
        let place = if delay_us == 0 {
            Some(
                self.gate(upstream, &live.upstreams[up], facts)
                    .await
                    .map_err(with_quota)?,
            )
        } else {
            None
        };
        crate::proxy::retarget(upstream, parts).map_err(Answer::from)?;
        // A queued request is billed once its wait is over: one whose client leaves the queue
        // never reaches the upstream.
        if delay_us == 0 {
            facts.metered = c.key.map(|(k, _)| k);
        }
        facts.admitted = true;
        Ok(Forward {
            upstream: up,
            fields: RateFields { budget, quota },
            paid,
            seats,
            classified: c,
            place,
            delay_us,
        })
    }

    /// One store call for a batch whose first `paying` items are what the request pays; any
    /// after them cost 0 and only read their buckets (a usage route's), so the decision, the
    /// metrics and the span speak for the first alone. The batch is borrowed, not moved: it is a
    /// few hundred bytes, and every move through an async call is a copy.
    pub(super) async fn check(
        &self,
        snap: &Snapshot,
        h: &Handles,
        batch: &Batch,
        paying: usize,
        facts: &mut Facts,
    ) -> Result<(Decision, Outcome), StoreError> {
        let started = Instant::now();
        let result = self.store.check(batch).await;
        let took = started.elapsed();
        self.metrics.store_check_seconds.observe(took.as_secs_f64());
        let outcome = match result {
            Ok(o) => o,
            Err(e) => {
                facts.check = Some(crate::otel::Checked::failed(took));
                let kind = if e == StoreError::Timeout {
                    "timeout"
                } else {
                    "error"
                };
                self.metrics
                    .store_errors
                    .get_or_create(&tollgate_telemetry::metrics::Kind { kind })
                    .inc();
                return Err(e);
            }
        };
        facts.checked_at = Some(outcome.now_us);
        let paid = &batch[..paying.min(batch.len())];
        let decision = decide(paid, &outcome);
        self.note_blocks(snap, paid, &outcome);
        facts.check = Some(crate::otel::Checked::new(took, &decision));
        self.count(snap, h, paid, &decision);
        Ok((decision, outcome))
    }

    /// Admissions count once per enforced limit paid; a limited or unavailable request counts
    /// for the limit that decided it. Shadow limits count what they would have refused.
    pub(super) fn count(
        &self,
        snap: &Snapshot,
        h: &Handles,
        batch: &[tollgate_store::CheckItem],
        d: &Decision,
    ) {
        if d.admitted() {
            for item in batch.iter().filter(|i| !i.charge.shadow) {
                h.decision(&self.metrics, item.limit as usize, d);
            }
        } else if let Some(i) = d.deciding {
            h.decision(&self.metrics, batch[i].limit as usize, d);
        }
        for &li in &d.shadow_refusals {
            let name = &snap.limits[li as usize].name;
            h.shadow(&self.metrics, li as usize);
            if let Some(suppressed) = self.shadow_log.allow(li as usize) {
                tracing::info!(
                    limit = &**name,
                    suppressed,
                    request_admitted = d.admitted(),
                    "shadow limit would have refused this request"
                );
            }
        }
    }

    /// The limiter's part of a request whose head (and body field, if its route keys on one) is
    /// known: the check to report in headers, or the answer that ends the request.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn limit(
        &self,
        snap: &Snapshot,
        route: &tollgate_rules::Route,
        c: &Classified,
        headers: &http::HeaderMap,
        body_value: Option<&[u8]>,
        h: &Handles,
        facts: &mut Facts,
    ) -> Result<Charged, Answer> {
        let key_idx = c.key.map(|k| k.0);
        let caller = c.caller();
        // Seats first: they are given back when this request ends, whatever ends it.
        let seats = match key_idx {
            Some(k)
                if route
                    .costs
                    .iter()
                    .any(|&(li, _)| snap.limits[li as usize].concurrent.is_some()) =>
            {
                self.take_seats(snap, route, k, facts).await?
            }
            _ => Vec::new(),
        };
        let mut batch = match plan::build_for(snap, route, caller, c.ip, c.fingerprint, headers, body_value) {
            Ok(b) => b,
            Err(e) => return Err(Refusal::BadRequest(e.to_string()).into()),
        };
        if let Some(r) = &self.regions {
            r.apply(snap, key_idx, &mut batch);
        }
        if batch.is_empty() {
            return Ok(Charged {
                seats,
                ..Charged::default()
            });
        }
        let (d, outcome) = match self.check(snap, h, &batch, batch.len(), facts).await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "limiter store failed");
                return Err(Refusal::LimiterUnavailable.into());
            }
        };
        facts.limit = deciding_name(snap, &batch, &d);
        let delay_us = d.delay_us;
        match d {
            Decision::Admitted(_) => {}
            Decision::Unavailable(_) => return Err(Refusal::LimiterUnavailable.into()),
            Decision::Limited(..) => {
                let budget = crate::respond::budget_values(snap, &batch, caller, &d);
                return Err(with_budget(rate_limited(snap, &batch, &d), budget));
            }
        }
        Ok(Charged {
            budget: crate::respond::budget_values(snap, &batch, caller, &d),
            // Boxed: it travels with the request to its end, and a pointer moves for less than
            // the few hundred bytes of a batch and its outcome.
            paid: Some(Box::new(Paid { batch, outcome })),
            seats,
            delay_us,
        })
    }

    /// One seat of each limit on requests in flight the route names, for the key; a full
    /// limit is a 429 and gives back the seats already taken.
    pub(super) async fn take_seats(
        &self,
        snap: &Snapshot,
        route: &tollgate_rules::Route,
        key: usize,
        facts: &mut Facts,
    ) -> Result<Vec<Seat>, Answer> {
        let mut seats = Vec::new();
        for &(li, _) in &route.costs {
            let limit = &snap.limits[li as usize];
            let Some(c) = &limit.concurrent else { continue };
            let name = format!("seats:{{{}}}:{}", snap.keys[key].tenant, limit.name);
            let taken = match self.seats.take(&name, c.max).await {
                Ok(t) => t,
                Err(e) => match limit.policy {
                    FailurePolicy::Open => continue,
                    FailurePolicy::Closed => {
                        tracing::warn!(error = %e, limit = %limit.name, "seats of a limit on requests in flight can't be taken; closed");
                        return Err(Refusal::LimiterUnavailable.into());
                    }
                    FailurePolicy::Local => match self.local_seats.take(&name, c.max).await {
                        Ok(t) => t,
                        Err(_) => return Err(Refusal::LimiterUnavailable.into()),
                    },
                },
            };
            match taken {
                Taken::Seat(s) => seats.push(s),
                Taken::Full { in_use } => {
                    facts.limit = Some(limit.name.clone());
                    let refusal = Refusal::TooManyInFlight {
                        limit: limit.name.to_string(),
                        max: c.max,
                        in_flight: in_use,
                    };
                    let full = Budget::seats_taken(limit.name.clone(), c.policy.clone());
                    return Err(with_budget(refusal, Some(full)));
                }
            }
        }
        Ok(seats)
    }

    /// Load shedding by the upstream's own health, apart from every client's limits: a place
    /// under its adaptive limit (refused at once) and its `max_in_flight` (waited for up to
    /// `queue_timeout`), held until the response body is done.
    pub(super) async fn gate(
        &self,
        upstream: &tollgate_rules::Upstream,
        live: &LiveUpstream,
        facts: &mut Facts,
    ) -> Result<Place, Answer> {
        match live.places.acquire(upstream.queue_timeout).await {
            Some(p) => Ok(p),
            None => {
                facts.limit = Some(OVERLOADED.clone());
                Err(Refusal::UpstreamOverloaded { retry_after: 1 }.into())
            }
        }
    }

    /// A key's quota, from the flags metering set: over in this period is a 429 until the
    /// reset in the quota's time zone, before any bucket is charged; otherwise the quota's
    /// headers for the answer.
    pub(super) fn quota(
        &self,
        snap: &Snapshot,
        key: usize,
        quota: &Quota,
        facts: &mut Facts,
    ) -> Result<QuotaHeaders, Box<Answer>> {
        let now_ms = (self.clock.now_us() / 1000) as i64;
        let flags = self.quota_flags.load();
        let flag = flags.get(&*snap.keys[key].id);
        let period = quota.period(now_ms);
        let headers = QuotaHeaders::new(quota, &period, flag, now_ms);
        match flag {
            Some(f) if f.blocks(now_ms) && f.period == period.label => {
                facts.limit = Some(QUOTA.clone());
                let mut a = Answer::from(Refusal::QuotaExceeded {
                    quota: quota.per.as_str(),
                    retry_after: period.secs_to_reset(now_ms),
                    resets_at: period.resets_at,
                });
                a.fields.quota = Some(Box::new(headers));
                Err(Box::new(a))
            }
            _ => Ok(headers),
        }
    }
}
