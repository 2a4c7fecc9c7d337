//! What an operator watches of `tollgate meter`: how far behind the records it is, the
//! gateway identities that ended without an `end` record, and what became of each record, in
//! its own Prometheus registry, served as text at `/metrics` when `--metrics-listen` is given.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `raised` (added to a total), `repeat` (changed nothing), `end`, `malformed`.
    pub result: &'static str,
}

pub struct MeterMetrics {
    registry: Registry,
    pub unclean_ends: Counter,
    pub lag_seconds: Gauge<f64, AtomicU64>,
    pub records: Family<ResultLabel, Counter>,
}

impl MeterMetrics {
    pub fn new() -> Arc<MeterMetrics> {
        let mut registry = Registry::default();
        let unclean_ends = Counter::default();
        registry.register(
            "tollgate_meter_unclean_ends",
            "Gateway identities that fell silent without an end record (their last flush may be missing)",
            unclean_ends.clone(),
        );
        let lag_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "tollgate_meter_lag_seconds",
            "Age of the oldest usage record not yet added up; 0 when caught up",
            lag_seconds.clone(),
        );
        let records = Family::<ResultLabel, Counter>::default();
        registry.register(
            "tollgate_meter_records",
            "Usage records read, by what they did",
            records.clone(),
        );
        Arc::new(MeterMetrics {
            registry,
            unclean_ends,
            lag_seconds,
            records,
        })
    }

    pub fn count(&self, result: &'static str, n: usize) {
        if n > 0 {
            self.records
                .get_or_create(&ResultLabel { result })
                .inc_by(n as u64);
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

fn answer(metrics: &MeterMetrics, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let (status, ctype, body) = match req.uri().path() {
        "/metrics" => (StatusCode::OK, CONTENT_TYPE, metrics.render()),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "only /metrics is served here\n".to_string(),
        ),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, http::HeaderValue::from_static(ctype));
    resp
}

/// Binds `addr` and serves `/metrics` from a task; returns the bound address (for `:0`).
pub async fn serve(addr: SocketAddr, metrics: Arc<MeterMetrics>) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("--metrics-listen {addr}: cannot listen: {e}"))?;
    let bound = listener
        .local_addr()
        .map_err(|e| format!("--metrics-listen {addr}: {e}"))?;
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors, usually: wait rather than spin.
                    tracing::warn!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let resp = answer(&metrics, &req);
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(bound)
}
