//! What the tests that hold the express lane and hyper's path to one answer share: a kept
//! connection to a gateway, one exchange on it, and what differs between two answers or two
//! sets of upstream request heads.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::Answer;

/// Sent with every request: a valid id is kept, so both paths' answers can be compared on it.
pub const REQUEST_ID: &str = "paths-agree.0001";
/// Sent as `Host` to both gateways, so the upstream's `X-Forwarded-Host` is the same from both.
pub const HOST: &str = "gw.test";

/// One HTTP/1.1 connection of its own to `addr`, kept alive for as long as the gateway keeps it.
pub async fn connect(addr: SocketAddr) -> SendRequest<Empty<Bytes>> {
    let tcp = TcpStream::connect(addr).await.expect("the gateway accepts");
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("an HTTP/1.1 connection");
    tokio::spawn(conn);
    send
}

/// Sends one bodiless request on `conn` and reads its answer whole; `Err` when the connection
/// can't carry it.
pub async fn exchange(
    conn: &mut SendRequest<Empty<Bytes>>,
    method: &Method,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Answer, String> {
    conn.ready()
        .await
        .map_err(|e| format!("the connection is gone: {e}"))?;
    let mut req = Request::builder()
        .method(method.clone())
        .uri(path)
        .header("host", HOST)
        .header("x-request-id", REQUEST_ID);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let sent = conn.send_request(req.body(Empty::new()).unwrap());
    let resp = tokio::time::timeout(Duration::from_secs(10), sent)
        .await
        .map_err(|_| "no answer within 10 s".to_string())?
        .map_err(|e| format!("the exchange failed: {e}"))?;
    let (parts, body) = resp.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| format!("the body failed: {e}"))?
        .to_bytes();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// What differs between the lane's answer and hyper's path's, one line each: the status, each
/// end-to-end header, the body. The date and the connection's own framing are left out.
pub fn differences(lane: &Answer, general: &Answer) -> Vec<String> {
    let mut out = Vec::new();
    if lane.status != general.status {
        out.push(format!("status: lane {} / hyper {}", lane.status, general.status));
    }
    // A body sent chunked on one path and with a length on the other is framing, not content.
    let chunked = [lane, general]
        .iter()
        .any(|a| a.headers.contains_key(http::header::TRANSFER_ENCODING));
    let names: BTreeSet<&str> = lane
        .headers
        .keys()
        .chain(general.headers.keys())
        .map(|n| n.as_str())
        .filter(|n| !matches!(*n, "date" | "connection" | "keep-alive" | "transfer-encoding"))
        .filter(|n| !(chunked && *n == "content-length"))
        .collect();
    for name in names {
        let values = |a: &Answer| {
            a.headers
                .get_all(name)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect::<Vec<_>>()
        };
        let (l, g) = (values(lane), values(general));
        if l != g {
            out.push(format!("{name}: lane {l:?} / hyper {g:?}"));
        }
    }
    if lane.body != general.body {
        out.push(format!(
            "body: lane {:?} / hyper {:?}",
            String::from_utf8_lossy(&lane.body),
            String::from_utf8_lossy(&general.body)
        ));
    }
    out
}

/// Request heads as the upstream can compare them: the request line, then the header lines with
/// lowercased names, sorted.
pub fn normal(heads: &[String]) -> Vec<(String, Vec<String>)> {
    heads
        .iter()
        .map(|h| {
            let mut lines = h.lines();
            let first = lines.next().unwrap_or("").to_string();
            let mut rest: Vec<String> = lines
                .filter(|l| !l.is_empty())
                .map(|l| {
                    let (n, v) = l.split_once(':').unwrap_or((l, ""));
                    format!("{}: {}", n.to_ascii_lowercase(), v.trim())
                })
                .collect();
            rest.sort();
            (first, rest)
        })
        .collect()
}
