//! OpenTelemetry against real processes: `tollgate demo --otlp-endpoint` exporting to an
//! OTLP/HTTP receiver in this test, requests on the express lane, over hyper's path (a body, h2c)
//! and refused; the span's trace, parent and attributes, the `traceparent` the demo upstream
//! received (it echoes its request headers), sampling, and the flush at shutdown.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Http, K7, Tollgate};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// An exported span, as the test reads it.
#[derive(Debug, Clone)]
struct Span {
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    kind: i32,
    attrs: BTreeMap<String, String>,
    /// The resource's `service.name`.
    service: String,
}

impl Span {
    fn attr(&self, k: &str) -> Option<&str> {
        self.attrs.get(k).map(String::as_str)
    }
}

/// An OTLP/HTTP receiver on 127.0.0.1:0: every `POST /v1/traces` body, decoded.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
    /// Requests that were not a protobuf export on /v1/traces.
    strays: Arc<Mutex<Vec<String>>>,
}

impl Receiver {
    async fn start() -> (Receiver, SocketAddr) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let rx = Receiver::default();
        let r = rx.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = l.accept().await else { return };
                let r = r.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let r = r.clone();
                        async move { Ok::<_, hyper::Error>(r.take(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        (rx, addr)
    }

    async fn take(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let (parts, body) = req.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let protobuf = parts
            .headers
            .get("content-type")
            .is_some_and(|v| v.as_bytes() == b"application/x-protobuf");
        if parts.method != Method::POST || parts.uri.path() != "/v1/traces" || !protobuf {
            self.strays
                .lock()
                .unwrap()
                .push(format!("{} {} {:?}", parts.method, parts.uri, parts.headers));
            return Response::builder()
                .status(StatusCode::NOT_FOUND)
                .body(Full::new(Bytes::new()))
                .unwrap();
        }
        let export = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export");
        let mut spans = self.spans.lock().unwrap();
        for rs in export.resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .map(|kv| text(kv.value.as_ref().and_then(|v| v.value.as_ref())))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    spans.push(Span {
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent: hex(&s.parent_span_id),
                        name: s.name,
                        kind: s.kind,
                        attrs: s
                            .attributes
                            .iter()
                            .map(|kv| {
                                (
                                    kv.key.clone(),
                                    text(kv.value.as_ref().and_then(|v| v.value.as_ref())),
                                )
                            })
                            .collect(),
                        service: service.clone(),
                    });
                }
            }
        }
        // An empty ExportTraceServiceResponse.
        Response::builder()
            .header("content-type", "application/x-protobuf")
            .body(Full::new(Bytes::new()))
            .unwrap()
    }

    fn all(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of `trace_id`, waiting up to 20 s for at least one.
    async fn wait_for(&self, trace_id: &str) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let found: Vec<Span> = self
                .all()
                .into_iter()
                .filter(|s| s.trace_id == trace_id)
                .collect();
            if !found.is_empty() {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "no span of trace {trace_id} exported in 20 s; got {:?}; strays {:?}",
                self.all(),
                self.strays.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// A demo gateway exporting to `receiver` every 100 ms.
fn gateway(receiver: SocketAddr, extra: &[&str]) -> Tollgate {
    let endpoint = format!("http://{receiver}");
    let mut args = vec!["demo", "--otlp-endpoint", &endpoint];
    args.extend_from_slice(extra);
    Tollgate::spawn_with_env(&args, &[("OTEL_BSP_SCHEDULE_DELAY", "100")])
}

/// The `traceparent` the demo upstream received, from its echo.
fn upstream_traceparent(body: &serde_json::Value) -> String {
    body["headers"]["traceparent"]
        .as_str()
        .unwrap_or_else(|| panic!("the upstream got no traceparent: {body}"))
        .to_string()
}

/// The span the upstream's `traceparent` names: same trace, the gateway's span, the flag.
fn assert_names_span(traceparent: &str, span: &Span, sampled: bool) {
    let flags = if sampled { "01" } else { "00" };
    assert_eq!(
        traceparent,
        format!("00-{}-{}-{flags}", span.trace_id, span.span_id),
        "the upstream's traceparent names the gateway's span"
    );
}

fn caller_traceparent(trace: &str, flags: &str) -> String {
    format!("00-{trace}-{CALLER_SPAN}-{flags}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_request_continues_the_callers_trace() {
    let (rx, addr) = Receiver::start().await;
    let gw = gateway(addr, &[]);
    let http = Http::new();
    let tp = caller_traceparent(CALLER_TRACE, "01");
    let a = http
        .get(&gw.url("/v1/orders"), &[("x-api-key", K7), ("traceparent", &tp)])
        .await;
    assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
    let spans = rx.wait_for(CALLER_TRACE).await;
    assert_eq!(spans.len(), 1, "{spans:?}");
    let s = &spans[0];
    assert_eq!(s.parent, CALLER_SPAN, "the caller's span is the parent");
    assert_ne!(s.span_id, CALLER_SPAN);
    assert_eq!(s.kind, SpanKind::Server as i32);
    assert_eq!(s.name, "GET orders");
    assert_eq!(s.service, "tollgate");
    assert_eq!(s.attr("tollgate.route"), Some("orders"));
    assert_eq!(s.attr("tollgate.key_id"), Some("k-7"));
    assert_eq!(s.attr("tollgate.decision"), Some("admitted"));
    assert_eq!(s.attr("tollgate.limit"), None);
    assert_eq!(s.attr("http.response.status_code"), Some("200"));
    assert_eq!(s.attr("http.request.method"), Some("GET"));
    assert_eq!(s.attr("tollgate.request_id"), a.header("x-request-id"));
    let check_us: u64 = s
        .attr("tollgate.store.check_us")
        .expect("the store's check latency")
        .parse()
        .unwrap();
    assert!(check_us < 10_000_000, "{check_us}");
    // The secret never leaves in a span.
    assert!(!format!("{s:?}").contains(K7), "{s:?}");
    assert_names_span(&upstream_traceparent(&a.json()), s, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_paths_continue_the_callers_trace() {
    let (rx, addr) = Receiver::start().await;
    let gw = gateway(addr, &[]);
    // A body: hyper's path.
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let tp = caller_traceparent(trace, "01");
    let a = Http::new()
        .send(
            Method::POST,
            &gw.url("/v1/things"),
            &[("x-api-key", K7), ("traceparent", &tp)],
            b"{\"n\": 1}",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
    assert_eq!(a.json()["bytes"], 8, "the body went up: {}", a.json());
    let spans = rx.wait_for(trace).await;
    assert_eq!(spans.len(), 1, "{spans:?}");
    let s = &spans[0];
    assert_eq!(s.parent, CALLER_SPAN);
    assert_eq!(s.name, "POST v1");
    assert_eq!(s.attr("tollgate.route"), Some("v1"));
    assert_eq!(s.attr("tollgate.key_id"), Some("k-7"));
    assert_eq!(s.attr("tollgate.decision"), Some("admitted"));
    assert_eq!(s.attr("http.response.status_code"), Some("200"));
    assert!(s.attr("tollgate.store.check_us").is_some());
    assert_names_span(&upstream_traceparent(&a.json()), s, true);

    // h2c: hyper's path too.
    let trace = "b7ad6b7169203331b7ad6b7169203331";
    let tp = caller_traceparent(trace, "01");
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::get(gw.url("/v1/orders"))
        .header("x-api-key", K7)
        .header("traceparent", &tp)
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), StatusCode::OK);
    let body: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let spans = rx.wait_for(trace).await;
    assert_eq!(spans.len(), 1, "{spans:?}");
    assert_eq!(spans[0].parent, CALLER_SPAN);
    assert_eq!(spans[0].attr("tollgate.route"), Some("orders"));
    assert_names_span(&upstream_traceparent(&body), &spans[0], true);
}

/// `exports` allows one POST per 5 s: the second is refused, on the lane (no body) and on
/// hyper's path (a body) alike, and each refusal's span names the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_requests_span_names_the_limit() {
    let (rx, addr) = Receiver::start().await;
    let gw = gateway(addr, &[]);
    let http = Http::new();
    let traces = [
        ("11111111111111111111111111111111", &b""[..]),
        ("22222222222222222222222222222222", &b""[..]),
        ("33333333333333333333333333333333", &b"{}"[..]),
    ];
    let mut statuses = vec![];
    for (trace, body) in traces {
        let tp = caller_traceparent(trace, "01");
        let a = http
            .send(
                Method::POST,
                &gw.url("/v1/exports"),
                &[("x-api-key", K7), ("traceparent", &tp)],
                body,
            )
            .await;
        statuses.push(a.status);
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let first = rx.wait_for(traces[0].0).await;
    assert_eq!(first[0].attr("tollgate.decision"), Some("admitted"));
    for (trace, _) in &traces[1..] {
        let spans = rx.wait_for(trace).await;
        assert_eq!(spans.len(), 1, "{spans:?}");
        let s = &spans[0];
        assert_eq!(s.parent, CALLER_SPAN);
        assert_eq!(s.name, "POST exports");
        assert_eq!(s.attr("tollgate.decision"), Some("limited"));
        assert_eq!(s.attr("tollgate.limit"), Some("exports"));
        assert_eq!(s.attr("tollgate.key_id"), Some("k-7"));
        assert_eq!(s.attr("http.response.status_code"), Some("429"));
        assert!(s.attr("tollgate.store.check_us").is_some());
    }
}

/// No `traceparent`, or one W3C Trace Context calls invalid: a new trace, without a parent, which the
/// upstream's `traceparent` names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_valid_traceparent_the_gateway_starts_a_trace() {
    let (rx, addr) = Receiver::start().await;
    let gw = gateway(addr, &[]);
    let http = Http::new();
    for sent in [
        None,
        Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
        Some("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        Some("not a traceparent"),
    ] {
        let mut headers = vec![("x-api-key", K7)];
        if let Some(tp) = sent {
            headers.push(("traceparent", tp));
        }
        let a = http.get(&gw.url("/v1/orders"), &headers).await;
        assert_eq!(a.status, StatusCode::OK);
        let up = upstream_traceparent(&a.json());
        let trace = up.split('-').nth(1).unwrap().to_string();
        assert_ne!(trace, CALLER_TRACE);
        let spans = rx.wait_for(&trace).await;
        assert_eq!(spans.len(), 1, "{spans:?}");
        assert_eq!(spans[0].parent, "", "a new trace has no parent ({sent:?})");
        assert_names_span(&up, &spans[0], true);
    }
}

/// Parent-based sampling at ratio 0: new traces and callers' unsampled ones are not exported,
/// though the upstream still learns the trace, unsampled; a caller's sampled trace is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_honours_the_callers_flag() {
    let (rx, addr) = Receiver::start().await;
    let gw = gateway(addr, &["--otlp-sample-ratio", "0"]);
    let http = Http::new();
    let unsampled = "44444444444444444444444444444444";
    let a = http
        .get(
            &gw.url("/v1/orders"),
            &[
                ("x-api-key", K7),
                ("traceparent", &caller_traceparent(unsampled, "00")),
            ],
        )
        .await;
    let up = upstream_traceparent(&a.json());
    assert!(
        up.starts_with(&format!("00-{unsampled}-")) && up.ends_with("-00"),
        "{up}"
    );
    assert!(!up.contains(CALLER_SPAN), "{up}");
    let b = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
    let new_trace = upstream_traceparent(&b.json());
    assert!(new_trace.ends_with("-00"), "{new_trace}");
    // Spans leave in the order requests end: once the last request's is here, any of the
    // earlier ones would be too.
    let sampled = "55555555555555555555555555555555";
    http.get(
        &gw.url("/v1/orders"),
        &[
            ("x-api-key", K7),
            ("traceparent", &caller_traceparent(sampled, "01")),
        ],
    )
    .await;
    rx.wait_for(sampled).await;
    let traces: Vec<String> = rx.all().into_iter().map(|s| s.trace_id).collect();
    assert_eq!(traces, [sampled], "only the caller's sampled trace is exported");
}

/// The store away: the limit's failure policy (`local`, the default) decides, and the span
/// says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_policys_decision_is_in_the_span() {
    let (rx, addr) = Receiver::start().await;
    // Nothing listens there: the gateway starts degraded.
    let store = format!("redis://127.0.0.1:{}", common::free_port());
    let gw = gateway(addr, &["--store", &store, "--fleet-size", "1"]);
    let tp = caller_traceparent(CALLER_TRACE, "01");
    let a = Http::new()
        .get(&gw.url("/v1/orders"), &[("x-api-key", K7), ("traceparent", &tp)])
        .await;
    assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
    let spans = rx.wait_for(CALLER_TRACE).await;
    let s = &spans[0];
    assert_eq!(s.attr("tollgate.decision"), Some("admitted"));
    assert_eq!(s.attr("tollgate.failure_policy"), Some("local"), "{s:?}");
    assert!(s.attr("tollgate.store.check_us").is_some());
}

/// Off by default: nothing is exported, and the caller's `traceparent` reaches the upstream
/// unchanged, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_flag_the_callers_traceparent_passes_through() {
    let gw = Tollgate::spawn(&["demo"]);
    let tp = caller_traceparent(CALLER_TRACE, "01");
    let a = Http::new()
        .get(&gw.url("/v1/orders"), &[("x-api-key", K7), ("traceparent", &tp)])
        .await;
    assert_eq!(upstream_traceparent(&a.json()), tp);
}

/// Spans still queued at SIGTERM are sent before the process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_flushes_the_queue() {
    let (rx, addr) = Receiver::start().await;
    let endpoint = format!("http://{addr}");
    // The schedule would export in an hour: only the flush at shutdown sends it.
    let mut gw = Tollgate::spawn_with_env(
        &["demo", "--otlp-endpoint", &endpoint, "--drain-timeout", "1s"],
        &[("OTEL_BSP_SCHEDULE_DELAY", "3600000")],
    );
    let tp = caller_traceparent(CALLER_TRACE, "01");
    let a = Http::new()
        .get(&gw.url("/v1/orders"), &[("x-api-key", K7), ("traceparent", &tp)])
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(rx.all().is_empty(), "exported before shutdown: {:?}", rx.all());
    gw.signal("TERM");
    let status = tokio::task::spawn_blocking(move || {
        let s = gw.child.wait().expect("tollgate exits");
        (s, gw)
    })
    .await
    .unwrap();
    assert!(status.0.success(), "{:?}: {}", status.0, status.1.stderr());
    let spans = rx.wait_for(CALLER_TRACE).await;
    assert_eq!(spans.len(), 1);
}

#[test]
fn bad_flags_are_refused_by_name() {
    for (args, says) in [
        (
            vec!["--otlp-endpoint", "https://127.0.0.1:4318"],
            "https is not supported",
        ),
        (
            vec!["--otlp-endpoint", "127.0.0.1:4318"],
            "must start with http://",
        ),
        (
            vec![
                "--otlp-endpoint",
                "http://127.0.0.1:4318",
                "--otlp-sample-ratio",
                "1.5",
            ],
            "must be from 0.0 to 1.0",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("demo")
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains(says) && err.contains("--otlp-"), "{args:?}: {err}");
    }
}
