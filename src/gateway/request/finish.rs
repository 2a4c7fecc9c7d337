//! A request's end: its access line, metrics and span, written once by [`Begun`]'s record.

use std::sync::atomic::Ordering;

use super::Gateway;
use crate::request::{Begun, End, NO_ROUTE, access_line};

impl Gateway {
    /// Ends a request with the status its client got: its metrics and its access line.
    pub(crate) fn finish(&self, mut b: Begun<'_>, status: u16) {
        b.end = End::Answered(status);
    }

    pub(super) fn record(&self, b: &mut Begun<'_>, status: u16) {
        if let Some(counter) = b.facts.metered.and_then(|k| b.live.meter.get(k)) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        if status == 429
            && let Some(k) = &b.facts.key_id
        {
            self.dashboard.refused.add(k);
        }
        b.live
            .handles
            .request(&self.metrics, b.facts.route, &NO_ROUTE, status);
        if let Some(log) = &self.access {
            // None: handed to the answer's body, which writes it when it is sent.
            if let Some(r) = access_line(b, status) {
                log.send(r);
            }
            return;
        }
        let route = b.facts.route.map_or("(none)", |r| &*b.snap.routes[r].name);
        let (upstream_target, attempts) = match b.facts.tried {
            Some((u, t)) => (&*b.live.upstreams[u].targets.list[t.target].label, t.attempts),
            None => ("-", 0),
        };
        // Not `target`: an event's `target` is the `tracing` target, `tollgate::access`.
        tracing::info!(
            target: "tollgate::access",
            method = b.method.as_str(),
            route,
            status,
            limit = b.facts.limit.as_deref().unwrap_or("-"),
            key = b.facts.key_id.as_deref().unwrap_or("-"),
            fingerprint = %b.facts.fingerprint,
            latency_us = b.started.elapsed().as_micros() as u64,
            request_id = b.request_id.to_str().unwrap_or("-"),
            upstream_target,
            attempts,
            "request"
        );
    }

    /// Ends a request's span with what its access line says.
    pub(super) fn end_span(&self, b: &Begun<'_>, span: &crate::otel::RequestSpan, status: u16) {
        if let Some(o) = &self.otel {
            o.end(span, &b.facts.facts(b, status));
        }
    }
}
