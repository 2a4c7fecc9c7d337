//! HTTP/2 over TLS (ALPN) with the demo certificate, h2c with prior knowledge, and a 100 MB body
//! streamed through a real gateway process with flat memory.

mod common;

use bytes::Bytes;
use common::{K7, Tollgate};
use http::{Request, StatusCode, Version};
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tollgate_gateway::app::{self, GatewayConfig, RulesSource};

async fn tls_gateway() -> (app::Running, tempfile::TempDir) {
    let upstream = common::start_demo_upstream().await;
    let (dir, path) = common::rules_file(&common::demo_rules_for(upstream));
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    let certs = common::repo().join("certs");
    cfg.tls = Some((certs.join("demo-cert.pem"), certs.join("demo-key.pem")));
    (app::start(cfg).await.expect("TLS gateway starts"), dir)
}

#[tokio::test]
async fn h2_over_tls_by_alpn() {
    let (gw, _dir) = tls_gateway().await;
    let tls = common::tls::connect(gw.addr, &[b"h2", b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::get(format!("https://localhost:{}/v1/orders", gw.addr.port()))
        .header("authorization", format!("Bearer {K7}"))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.version(), Version::HTTP_2);
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers().contains_key("ratelimit"));
    let body: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["headers"]["x-forwarded-proto"], "https");
}

#[tokio::test]
async fn http1_over_tls_by_alpn() {
    let (gw, _dir) = tls_gateway().await;
    let tls = common::tls::connect(gw.addr, &[b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::get("/v1/orders")
        .header("host", "localhost")
        .header("authorization", format!("Bearer {K7}"))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.version(), Version::HTTP_11);
    assert_eq!(resp.status(), StatusCode::OK);
}

#[tokio::test]
async fn h2c_with_prior_knowledge() {
    let (gw, _clock, _dir) = common::demo_gateway().await;
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    for expected in [StatusCode::OK, StatusCode::OK] {
        let req = Request::get(format!("http://{}/v1/orders", gw.addr))
            .header("x-api-key", K7)
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.version(), Version::HTTP_2);
        assert_eq!(resp.status(), expected);
    }
}

#[tokio::test]
async fn bad_certificate_files_are_named() {
    let (_dir, path) = common::rules_file(&common::demo_rules_for("127.0.0.1:9".parse().unwrap()));
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    let missing = common::repo().join("certs/no-such-cert.pem");
    cfg.tls = Some((missing.clone(), common::repo().join("certs/demo-key.pem")));
    let err = app::start(cfg)
        .await
        .err()
        .expect("missing cert refused")
        .to_string();
    assert!(err.contains("no-such-cert.pem"), "{err}");

    let (_d2, path) = common::rules_file(&common::demo_rules_for("127.0.0.1:9".parse().unwrap()));
    let mut cfg = GatewayConfig::new(RulesSource::File(path.clone()));
    // A file that is not a certificate at all.
    cfg.tls = Some((path.clone(), common::repo().join("certs/demo-key.pem")));
    let err = app::start(cfg).await.err().expect("bad cert refused").to_string();
    assert!(err.contains("rules.json"), "{err}");
}

/// 100 MB up through the gateway process to the demo upstream, sent as a stream of 64 KiB
/// chunks. If the gateway buffered the body, its peak RSS would grow by about 100 MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_body_streams_with_flat_memory() {
    let upstream = common::start_demo_upstream().await;
    // Bodies are capped at 1 MiB unless a route says otherwise; this one does.
    let catch_all = r#""path": "/v1/", "upstream": "orders","#;
    let rules = common::demo_rules_for(upstream);
    assert!(rules.contains(catch_all), "the demo's catch-all route moved");
    let rules = rules.replace(
        catch_all,
        &format!(r#"{catch_all} "max_body_bytes": {},"#, 200 << 20),
    );
    let (_dir, path) = common::rules_file(&rules);
    let gw = Tollgate::spawn(&["serve", "--rules", path.to_str().unwrap()]);
    const CHUNK: usize = 64 * 1024;
    const TOTAL: usize = 100 * 1024 * 1024;
    let chunk = Bytes::from(vec![b'x'; CHUNK]);
    let frames = futures_stream(chunk, TOTAL / CHUNK);
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let before = gw.peak_rss_kib();
    let req = Request::post("/v1/uploads")
        .header("host", "localhost")
        .header("authorization", format!("Bearer {K7}"))
        .body(StreamBody::new(frames))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["bytes"], TOTAL as u64, "the upstream saw every byte");
    let after = gw.peak_rss_kib();
    assert!(before > 0 && after > 0, "could not read the gateway's memory");
    let growth_mib = (after.saturating_sub(before)) / 1024;
    assert!(
        growth_mib < 32,
        "peak RSS grew by {growth_mib} MiB while streaming 100 MiB ({before} -> {after} KiB)"
    );
}

/// A stream of `n` copies of `chunk` as body frames, produced lazily.
fn futures_stream(
    chunk: Bytes,
    n: usize,
) -> impl futures_core::Stream<Item = Result<Frame<Bytes>, std::io::Error>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
    tokio::spawn(async move {
        for _ in 0..n {
            if tx.send(Ok(Frame::data(chunk.clone()))).await.is_err() {
                return;
            }
        }
    });
    ReceiverStream(rx)
}

struct ReceiverStream<T>(tokio::sync::mpsc::Receiver<T>);

impl<T> futures_core::Stream for ReceiverStream<T> {
    type Item = T;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        self.0.poll_recv(cx)
    }
}
