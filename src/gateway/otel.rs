//! OpenTelemetry tracing: one server span per request, continuing the caller's W3C
//! `traceparent`, exported over OTLP/HTTP (protobuf) in batches, and the gateway's own
//! `traceparent` sent upstream.
//!
//! Off (no `--otlp-endpoint`), none of this runs: a request carries `None` and pays one branch
//! at its start, one in its header edits and one at its end. On, a request's start reads the
//! caller's `traceparent`, draws its ids and decides sampling (parent-based: the caller's
//! sampled flag, else `--otlp-sample-ratio` of new traces, by trace id as the SDK's
//! `TraceIdRatioBased` does); its end builds the span's data once, with every attribute, and
//! only when it is sampled. Spans go to the SDK's batch span processor on the tokio runtime,
//! whose queue never blocks a request: past [`QUEUE`] spans waiting, a span is dropped and
//! counted (`tollgate_otlp_spans_dropped_total`).

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::runtime::Tokio;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, SpanData, SpanEvents, SpanExporter, SpanLinks, SpanProcessor,
};
use prometheus_client::metrics::counter::Counter;
use tollgate_limit::batch::{FailurePolicy, Source};
use tollgate_limit::decision::Decision;

pub(crate) static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// Spans waiting for export at most; past it a request's span is dropped, never waited for.
pub(crate) const QUEUE: usize = 8192;
/// Spans in one OTLP request.
const BATCH: usize = 512;
/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for the last spans to go out.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Where spans go and which share of new traces is kept.
#[derive(Debug, Clone)]
pub struct OtlpConfig {
    /// The collector's base URL (`http://HOST:PORT`, maybe with a path); spans are POSTed to
    /// its `/v1/traces`.
    pub endpoint: String,
    /// The share of new traces sampled; a caller's sampled flag decides for its own.
    pub sample_ratio: f64,
}

impl OtlpConfig {
    /// The URL spans are sent to: the base endpoint's `/v1/traces`, as the OTLP exporter
    /// specification says of `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub(crate) fn traces_url(&self) -> String {
        format!("{}/v1/traces", self.endpoint.trim_end_matches('/'))
    }
}

/// `--otlp-endpoint`: an `http://` URL with a host. The exporter's client speaks plain HTTP
/// only, so `https://` is refused here rather than failing every export later.
pub(crate) fn parse_endpoint(text: &str) -> Result<String, String> {
    let uri: http::Uri = text.parse().map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!(
                "{text:?}: https is not supported; export to a collector's plain http:// OTLP port (4318)"
            ));
        }
        _ => return Err(format!("{text:?} must start with http://")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("{text:?} has no host"));
    }
    if uri.query().is_some() {
        return Err(format!("{text:?}: a query has no place in the endpoint"));
    }
    Ok(text.to_string())
}

/// `--otlp-sample-ratio`: a number from 0.0 to 1.0.
pub(crate) fn parse_ratio(text: &str) -> Result<f64, String> {
    let r: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    if !(0.0..=1.0).contains(&r) {
        return Err(format!("{text:?} must be from 0.0 to 1.0"));
    }
    Ok(r)
}

/// A running exporter: the batch span processor and what every span shares.
pub(crate) struct Otel {
    processor: BatchSpanProcessor<Tokio>,
    /// A new trace is sampled when its id's low 63 bits fall under this bound.
    ratio_bound: u64,
    scope: InstrumentationScope,
    /// Spans handed to the processor and not yet taken by an export.
    queued: Arc<AtomicUsize>,
    dropped: Counter,
}

impl std::fmt::Debug for Otel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Otel")
            .field("ratio_bound", &self.ratio_bound)
            .finish_non_exhaustive()
    }
}

/// The OTLP exporter, counting the spans each export takes out of the queue.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    queued: Arc<AtomicUsize>,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        self.queued.fetch_sub(batch.len(), Ordering::Relaxed);
        self.inner.export(batch)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

impl Otel {
    /// Starts the exporter on the current tokio runtime. `dropped` counts spans refused for a
    /// full queue.
    pub fn start(cfg: &OtlpConfig, dropped: Counter) -> Result<Otel, String> {
        let url = cfg.traces_url();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| format!("--otlp-endpoint {}: {e}", cfg.endpoint))?;
        let queued = Arc::new(AtomicUsize::new(0));
        let counted = Counted {
            inner: exporter,
            queued: queued.clone(),
        };
        // The schedule delay still follows OTEL_BSP_SCHEDULE_DELAY; the sizes are ours, since
        // the drop count depends on the queue's.
        let config = BatchConfigBuilder::default()
            .with_max_queue_size(QUEUE)
            .with_max_export_batch_size(BATCH)
            .build();
        let mut processor = BatchSpanProcessor::builder(counted, Tokio)
            .with_batch_config(config)
            .build();
        processor.set_resource(
            &Resource::builder_empty()
                .with_service_name("tollgate")
                .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                .build(),
        );
        tracing::info!(
            url,
            sample_ratio = cfg.sample_ratio,
            "exporting a span per request over OTLP/HTTP"
        );
        Ok(Otel {
            processor,
            ratio_bound: ratio_bound(cfg.sample_ratio),
            scope: InstrumentationScope::builder("tollgate")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            queued,
            dropped,
        })
    }

    /// A request's span at its start: the caller's `traceparent` continued when valid, a new
    /// trace otherwise.
    pub(crate) fn begin(&self, headers: &HeaderMap) -> Box<RequestSpan> {
        let parent = incoming(headers);
        let span_id = SpanId::from(nonzero_u64());
        let (trace_id, sampled) = match &parent {
            Some(p) => (p.trace_id, p.sampled),
            None => {
                let id = TraceId::from(nonzero_u128());
                (id, sampled_by_ratio(id, self.ratio_bound))
            }
        };
        Box::new(RequestSpan {
            trace_id,
            span_id,
            parent: parent.map(|p| p.span_id),
            sampled,
            start: SystemTime::now(),
            traceparent: traceparent(trace_id, span_id, sampled),
        })
    }

    /// Ends a request's span: exported when sampled, with what the request came to.
    pub(crate) fn end(&self, span: &RequestSpan, facts: &Facts<'_>) {
        if !span.sampled {
            return;
        }
        if self.queued.fetch_add(1, Ordering::Relaxed) >= QUEUE {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            self.dropped.inc();
            return;
        }
        self.processor.on_end(span.data(facts, &self.scope));
    }

    /// Sends what is queued and stops the exporter; waits at most a few seconds.
    pub async fn shutdown(self: Arc<Self>) {
        // The SDK blocks this thread until its task has exported: off the runtime's threads,
        // which that task needs.
        let done = tokio::task::spawn_blocking(move || self.processor.shutdown());
        match tokio::time::timeout(FLUSH_TIMEOUT, done).await {
            Ok(Ok(Ok(()))) => tracing::info!("the last spans were exported"),
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the last spans could not be exported"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the span exporter's shutdown failed"),
            Err(_) => tracing::warn!("the last spans were not exported in time"),
        }
    }
}

/// A valid incoming `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parent {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub sampled: bool,
}

/// The caller's trace context: exactly one `traceparent` that W3C Trace Context calls valid.
/// Anything else starts a new trace, as W3C Trace Context asks.
pub(crate) fn incoming(headers: &HeaderMap) -> Option<Parent> {
    let mut all = headers.get_all(&TRACEPARENT).iter();
    let v = all.next()?;
    if all.next().is_some() {
        return None;
    }
    parse_traceparent(v.as_bytes())
}

/// `VERSION-TRACEID-PARENTID-FLAGS`, lowercase hex. Version `ff` is invalid; version `00` is
/// exactly 55 bytes; a later version may add fields after a `-`, which are ignored.
pub(crate) fn parse_traceparent(v: &[u8]) -> Option<Parent> {
    if v.len() < 55 || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let version = hex_u128(&v[0..2])? as u8;
    if version == 0xff || (version == 0 && v.len() != 55) || (v.len() > 55 && v[55] != b'-') {
        return None;
    }
    let trace = hex_u128(&v[3..35])?;
    let span = hex_u128(&v[36..52])? as u64;
    let flags = hex_u128(&v[53..55])? as u8;
    if trace == 0 || span == 0 {
        return None;
    }
    Some(Parent {
        trace_id: TraceId::from(trace),
        span_id: SpanId::from(span),
        sampled: flags & 1 == 1,
    })
}

/// Lowercase hex only, as W3C Trace Context writes the fields.
fn hex_u128(b: &[u8]) -> Option<u128> {
    let mut n: u128 = 0;
    for &c in b {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        n = (n << 4) | u128::from(d);
    }
    Some(n)
}

fn traceparent(trace: TraceId, span: SpanId, sampled: bool) -> HeaderValue {
    let text = format!("00-{trace}-{span}-{}", if sampled { "01" } else { "00" });
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

fn nonzero_u128() -> u128 {
    loop {
        let n: u128 = rand::random();
        if n != 0 {
            return n;
        }
    }
}

fn nonzero_u64() -> u64 {
    loop {
        let n: u64 = rand::random();
        if n != 0 {
            return n;
        }
    }
}

/// The SDK's `TraceIdRatioBased`: a ratio of 2^63, compared with the trace id's low 63 bits, so
/// every service sampling by ratio keeps the same traces.
fn ratio_bound(ratio: f64) -> u64 {
    (ratio.clamp(0.0, 1.0) * (1u64 << 63) as f64) as u64
}

fn sampled_by_ratio(id: TraceId, bound: u64) -> bool {
    let low = u64::from_be_bytes(id.to_bytes()[8..16].try_into().unwrap_or([0; 8]));
    (low >> 1) < bound
}

/// One request's span while it runs: its ids, its parent, and the `traceparent` its upstream
/// gets.
pub(crate) struct RequestSpan {
    trace_id: TraceId,
    span_id: SpanId,
    parent: Option<SpanId>,
    sampled: bool,
    start: SystemTime,
    traceparent: HeaderValue,
}

impl RequestSpan {
    /// The upstream's `traceparent` names this span, in place of the caller's.
    pub(crate) fn propagate(&self, set: &mut smallvec::SmallVec<[(HeaderName, HeaderValue); 8]>) {
        set.push((TRACEPARENT.clone(), self.traceparent.clone()));
    }

    fn data(&self, f: &Facts<'_>, scope: &InstrumentationScope) -> SpanData {
        let mut attributes = Vec::with_capacity(10);
        attributes.push(KeyValue::new("http.request.method", f.method.to_string()));
        attributes.push(KeyValue::new("http.response.status_code", i64::from(f.status)));
        if let Some(r) = f.route {
            attributes.push(KeyValue::new("http.route", r.to_string()));
            attributes.push(KeyValue::new("tollgate.route", r.to_string()));
        }
        if let Some(k) = f.key_id {
            attributes.push(KeyValue::new("tollgate.key_id", k.to_string()));
        }
        attributes.push(KeyValue::new("tollgate.decision", f.decision()));
        if let Some(l) = f.refusing_limit() {
            attributes.push(KeyValue::new("tollgate.limit", l.to_string()));
        }
        if let Some(c) = f.check {
            attributes.push(KeyValue::new("tollgate.store.check_us", c.us as i64));
            if let Some(p) = c.policy {
                attributes.push(KeyValue::new("tollgate.failure_policy", policy_name(p)));
            }
        }
        attributes.push(KeyValue::new("tollgate.request_id", f.request_id.to_string()));
        let name = match f.route {
            Some(r) => format!("{} {r}", f.method),
            None => f.method.to_string(),
        };
        SpanData {
            span_context: SpanContext::new(
                self.trace_id,
                self.span_id,
                TraceFlags::SAMPLED,
                false,
                TraceState::NONE,
            ),
            parent_span_id: self.parent.unwrap_or(SpanId::INVALID),
            parent_span_is_remote: self.parent.is_some(),
            span_kind: SpanKind::Server,
            name: Cow::Owned(name),
            start_time: self.start,
            end_time: SystemTime::now(),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            // A server span is an error for the answers that are the server's fault.
            status: if f.status >= 500 {
                Status::error("")
            } else {
                Status::Unset
            },
            instrumentation_scope: scope.clone(),
        }
    }
}

fn policy_name(p: FailurePolicy) -> &'static str {
    match p {
        FailurePolicy::Local => "local",
        FailurePolicy::Open => "open",
        FailurePolicy::Closed => "closed",
    }
}

/// One store check as a request's span reports it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Checked {
    us: u64,
    /// The store could not decide and a failure policy refused (or the store failed).
    unavailable: bool,
    /// The failure policy that decided in the store's place.
    policy: Option<FailurePolicy>,
}

impl Checked {
    pub(crate) fn new(took: Duration, d: &Decision) -> Checked {
        let policy = match d.source {
            Source::Bypass(p) => Some(p),
            Source::Store => None,
        };
        Checked {
            us: took.as_micros() as u64,
            unavailable: matches!(d, Decision::Unavailable(_)),
            policy,
        }
    }

    /// A check the store failed outright (no guard in front to apply a failure policy).
    pub(crate) fn failed(took: Duration) -> Checked {
        Checked {
            us: took.as_micros() as u64,
            unavailable: true,
            policy: None,
        }
    }
}

/// What a request came to, for its span's attributes.
pub(crate) struct Facts<'a> {
    pub method: &'a http::Method,
    pub route: Option<&'a str>,
    pub key_id: Option<&'a str>,
    /// It got through the limits and was sent upstream.
    pub admitted: bool,
    /// The access line's `limit`: what refused it, or, when admitted, its tightest bucket.
    pub limit: Option<&'a str>,
    pub check: Option<Checked>,
    pub status: u16,
    pub request_id: &'a str,
}

impl Facts<'_> {
    /// `admitted`; else `unavailable` (a failure policy refused, or the store failed); else
    /// `limited` (by [`Facts::refusing_limit`]); else `refused` (answered before any limit: a
    /// bad request, no key, no route).
    fn decision(&self) -> &'static str {
        if self.admitted {
            "admitted"
        } else if self.check.is_some_and(|c| c.unavailable) {
            "unavailable"
        } else if self.limit.is_some() {
            "limited"
        } else {
            "refused"
        }
    }

    fn refusing_limit(&self) -> Option<&str> {
        if self.admitted { None } else { self.limit }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_valid_and_not() {
        let p = parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(p.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.span_id.to_string(), "00f067aa0ba902b7");
        assert!(p.sampled);
        let p = parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert!(!p.sampled);
        // A later version may carry more after a dash.
        assert!(parse_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz").is_some());
        for bad in [
            &b"00-00000000000000000000000000000000-00f067aa0ba902b7-01"[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn two_traceparents_start_a_new_trace() {
        let mut h = HeaderMap::new();
        let v = HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        h.append(&TRACEPARENT, v.clone());
        assert!(incoming(&h).is_some());
        h.append(&TRACEPARENT, v);
        assert_eq!(incoming(&h), None);
    }

    #[test]
    fn the_outgoing_traceparent_round_trips() {
        let v = traceparent(TraceId::from(0xabc_u128), SpanId::from(0x12_u64), true);
        assert_eq!(
            v.to_str().unwrap(),
            "00-00000000000000000000000000000abc-0000000000000012-01"
        );
        let p = parse_traceparent(v.as_bytes()).unwrap();
        assert_eq!(
            (p.trace_id, p.span_id, p.sampled),
            (TraceId::from(0xabc_u128), SpanId::from(0x12_u64), true)
        );
    }

    #[test]
    fn ratios_sample_their_share_of_trace_ids() {
        assert!((0..1000).all(|_| sampled_by_ratio(TraceId::from(nonzero_u128()), ratio_bound(1.0))));
        assert!((0..1000).all(|_| !sampled_by_ratio(TraceId::from(nonzero_u128()), ratio_bound(0.0))));
        let kept = (0..20_000)
            .filter(|_| sampled_by_ratio(TraceId::from(nonzero_u128()), ratio_bound(0.25)))
            .count();
        // 0.25 of 20,000 is 5,000; the binomial's deviation is about 61.
        assert!((4_500..5_500).contains(&kept), "{kept}");
    }

    #[test]
    fn flags_refuse_bad_values() {
        assert!(parse_endpoint("http://127.0.0.1:4318").is_ok());
        assert!(
            parse_endpoint("https://collector:4318")
                .unwrap_err()
                .contains("https")
        );
        assert!(parse_endpoint("collector:4318").is_err());
        assert!(parse_endpoint("http://").is_err());
        assert_eq!(parse_ratio("0.5"), Ok(0.5));
        assert!(parse_ratio("1.5").unwrap_err().contains("0.0 to 1.0"));
        assert!(parse_ratio("-0.1").is_err());
        assert!(parse_ratio("NaN").is_err());
        assert!(parse_ratio("half").is_err());
        let c = OtlpConfig {
            endpoint: "http://127.0.0.1:4318/".into(),
            sample_ratio: 1.0,
        };
        assert_eq!(c.traces_url(), "http://127.0.0.1:4318/v1/traces");
    }
}
