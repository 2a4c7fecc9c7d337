//! On the way to the upstream and back: the header edits the upstream sees, what its answer
//! settles (a post-paid debit, the adaptive limit's sample), and the refund of a request that
//! never reached it.

use tollgate_rules::Snapshot;
use tollgate_store::{Batch, Store};

use super::Gateway;
use super::begin::Facts;
use crate::request::{Begun, Forward, Paid};
use crate::server::ConnInfo;

use crate::proxy::Ask;
use crate::proxy::client::Failure;
use crate::proxy::targets::{Picking, caller_hash};
use crate::respond::Answer;

impl Gateway {
    /// What the exchange is asked to do for an admitted request: the upstream and its targets,
    /// whether a failed attempt may go again, and what the answer keeps. Out of `drive` for
    /// reading's sake only: inlined, it costs nothing.
    #[inline(always)]
    pub(super) fn ask<'a>(
        &self,
        b: &'a Begun<'_>,
        f: &Forward,
        parts: &'a http::request::Parts,
        (max_body, post_paid): (u64, bool),
        upgrade: Option<&'a str>,
    ) -> Ask<'a> {
        let upstream = &b.snap.upstreams[f.upstream];
        let targets = &b.live.upstreams[f.upstream].targets;
        Ask {
            upstream,
            targets,
            picking: if targets.several() {
                self.picking(b, f, upstream)
            } else {
                Default::default()
            },
            idempotent: tollgate_http1::idempotent(&parts.method)
                || parts.headers.contains_key(&crate::proxy::IDEMPOTENCY_KEY),
            parts,
            max_body,
            ours: f.fields.any(),
            post_paid,
            holds: f.place.as_ref().is_some_and(crate::concurrency::Place::limited) || !f.seats.is_empty(),
            upgrade,
        }
    }

    /// The answer to a request whose exchange failed (502, 504, or 408 for a client that
    /// stalled its body), after what it paid is refunded if it never reached the upstream or
    /// settled if it did. The rare path: its caller boxes it.
    pub(super) async fn failed(&self, b: &mut Begun<'_>, f: &mut Forward, failure: Failure) -> Answer {
        let upstream = &b.snap.upstreams[f.upstream];
        let mut a = Answer::from(crate::proxy::failure_answer(upstream, &failure));
        self.refund_undelivered(&b.snap, &mut b.facts, f.paid.take(), &failure)
            .await;
        a.fields = std::mem::take(&mut f.fields);
        // Already waited out for the body timeout: no more waiting for it.
        a.close = matches!(failure, Failure::ClientStalled);
        a
    }

    /// How the client's headers become the upstream's for a forwarded request.
    pub(crate) fn edits(
        &self,
        b: &Begun<'_>,
        f: &Forward,
        parts: &http::request::Parts,
        conn: &ConnInfo,
    ) -> crate::proxy::HeaderEdits {
        let up = &b.snap.upstreams[f.upstream];
        let mut edits =
            crate::proxy::HeaderEdits::new(up, parts, self.provenance(&b.snap, &f.classified, conn));
        if let Some(s) = &b.facts.span {
            s.propagate(&mut edits.set);
        }
        edits
    }

    /// What choosing a target of an upstream of several needs of the request: for
    /// `"balance": "hash"`, the caller's key id (a token's caller id), or its address without
    /// one.
    pub(crate) fn picking(&self, b: &Begun<'_>, f: &Forward, up: &tollgate_rules::Upstream) -> Picking {
        if up.balance != tollgate_rules::Balance::Hash {
            return Picking::default();
        }
        let c = &f.classified;
        let hash = match (&c.jwt, c.key) {
            (Some(j), _) => caller_hash(j.id.as_bytes()),
            (None, Some((k, _))) => caller_hash(b.snap.keys[k].id.as_bytes()),
            (None, None) => match c.ip {
                std::net::IpAddr::V4(a) => caller_hash(&a.octets()),
                std::net::IpAddr::V6(a) => caller_hash(&a.octets()),
            },
        };
        Picking { hash }
    }

    /// Records how long an upstream took to answer the head, and gives its adaptive limit the
    /// sample: an answer, or a timeout (the slowest answer there is). A failure to connect or
    /// to send says nothing about how fast the upstream serves.
    pub(crate) fn upstream_answered(
        &self,
        b: &Begun<'_>,
        f: &Forward,
        took: std::time::Duration,
        failure: Option<&crate::proxy::client::Failure>,
    ) {
        b.live.handles.upstream(&self.metrics, f.upstream, took);
        if let Some(a) = &b.live.upstreams[f.upstream].places.adaptive
            && matches!(failure, None | Some(crate::proxy::client::Failure::TimedOut))
        {
            a.sample(took);
        }
    }

    /// Gives back the charge of every limit charged on the upstream's answer (`charge_on`) whose
    /// statuses `status` is not, before the answer goes out: the client's next attempt sees
    /// the bucket as this answer left it.
    pub(crate) async fn settle(&self, snap: &Snapshot, paid: Option<&Paid>, status: Option<u16>) {
        let Some(p) = paid else { return };
        let given_back = |i: &tollgate_store::CheckItem| {
            let l = &snap.limits[i.limit as usize];
            l.charge_on.is_some() && !status.is_some_and(|s| l.keeps_charge(s))
        };
        if !p.outcome.admitted || !p.batch.iter().any(given_back) {
            return;
        }
        let places: smallvec::SmallVec<[usize; 4]> =
            (0..p.batch.len()).filter(|&i| given_back(&p.batch[i])).collect();
        let batch: Batch = places.iter().map(|&i| p.batch[i].clone()).collect();
        if let Err(e) = self.store.refund(&batch, &p.outcome.part(&places)).await {
            tracing::debug!(error = %e, "giving back a charge the answer did not keep failed");
        }
    }

    /// Settles a post-paid request once its answer's head is here: each post-paid bucket it
    /// paid is charged what the answer reports beyond the reserve (given back what it reports
    /// below), in one store call, before the head goes out. Its `RateLimit` then shows the
    /// bucket after the debit, and the next request sees any debt. An answer that does not
    /// say costs the reserve; one that says something else than a count is logged and costs
    /// the reserve too: the client is not refused for its upstream's fault.
    ///
    /// Returns the cost the answer reported, for the access line.
    pub(crate) async fn debit(
        &self,
        snap: &Snapshot,
        f: &mut Forward,
        headers: &http::HeaderMap,
    ) -> Option<u64> {
        let p = f.paid.as_deref()?;
        if !p.outcome.admitted {
            return None;
        }
        let mut reported_first = None;
        let mut units: smallvec::SmallVec<[i64; 4]> = smallvec::SmallVec::new();
        for (item, v) in p.batch.iter().zip(&p.outcome.buckets) {
            let limit = &snap.limits[item.limit as usize];
            let owed = match &limit.post_paid {
                Some(pp) if tollgate_limit::bucket::charged(&item.charge, v, true) => {
                    match pp.reported(headers) {
                        Ok(Some(n)) => {
                            reported_first = reported_first.or(Some(n));
                            pp.units(&item.charge.params, n)
                        }
                        Ok(None) => 0,
                        Err(why) => {
                            tracing::warn!(limit = %limit.name, "upstream's cost ignored: {why}");
                            0
                        }
                    }
                }
                _ => 0,
            };
            units.push(owed);
        }
        if units.iter().all(|u| *u == 0) {
            return reported_first;
        }
        match self.store.adjust(&p.batch, &p.outcome, &units).await {
            Ok(adjusted) => {
                let caller = f.classified.caller();
                if let Some(b) =
                    crate::respond::budget_after(snap, &p.batch, caller, &p.outcome, &adjusted.balances)
                {
                    f.fields.budget = Some(b);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "post-paid debit failed; the reserve stays the whole charge")
            }
        }
        reported_first
    }

    /// Gives an admitted request's charge back when it never reached its upstream, in the same
    /// all-or-nothing way it was taken. A refund that fails is logged and counted by the store's
    /// guard; the request's answer does not wait on a retry.
    pub(super) async fn refund_undelivered(
        &self,
        snap: &Snapshot,
        facts: &mut Facts,
        paid: Option<Box<Paid>>,
        failure: &Failure,
    ) {
        if !failure.undelivered() {
            // Delivered, but no answer came: no status a limit charged on the answer keeps.
            self.settle(snap, paid.as_deref(), None).await;
            return;
        }
        self.give_back(facts, paid).await;
    }

    /// Gives back what a request that never reached its upstream paid, and bills it to nobody.
    pub(super) async fn give_back(&self, facts: &mut Facts, paid: Option<Box<Paid>>) {
        facts.metered = None;
        if let Some(p) = paid {
            refund(&*self.store, &p).await;
        }
    }
}

/// One refund, logged when it fails: the request's answer does not wait on a retry.
pub(super) async fn refund(store: &dyn Store, p: &Paid) {
    if let Err(e) = store.refund(&p.batch, &p.outcome).await {
        tracing::debug!(error = %e, "refund of an undelivered request failed");
    }
}
