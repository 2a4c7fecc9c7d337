//! The express lane and hyper's general path (`--no-express`) answer alike: for every refusal
//! and limit the gateway answers with, two gateways on the same rules and the same upstream give
//! a keep-alive HTTP/1.1 client the same status, end-to-end headers and body, send the upstream
//! the same request head, and keep the connection for the next request; and the lane serves the
//! refusals it is compared on. The pair of gateways is `common::pair`.

mod common;
use std::time::Duration;

use common::agree::{HOST, REQUEST_ID};
use common::pair::{KEY, NOW, Pair, at, error_of, key};
use http::{Method, StatusCode};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tollgate_limit::clock::ManualClock;

#[tokio::test]
async fn refusals_before_any_limit_answer_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/nowhere", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::NOT_FOUND, "not_found".into())
    );
    p.both(Method::DELETE, "/nowhere", &key()).await;
    let a = p.both(Method::HEAD, "/nowhere", &key()).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(a.body.is_empty());
    // A `..` above the root, and encoded slashes on a route and off every route.
    for path in ["/../x", "/v1/orders/a%2Fb", "/v1/a%2Fb"] {
        let a = p.both(Method::GET, path, &key()).await;
        assert_eq!(
            (a.status, error_of(&a)),
            (StatusCode::BAD_REQUEST, "bad_request".into()),
            "{path}"
        );
    }
    let a = p.both(Method::HEAD, "/v1/orders/a%2Fb", &key()).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.body.is_empty());
    // Two keys that disagree.
    let a = p
        .both(
            Method::GET,
            "/v1/orders",
            &[("x-api-key", KEY), ("authorization", "Bearer another")],
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    // And then an admitted request, with its budget.
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.header("ratelimit").is_some(), "{:?}", a.headers);
    p.assert_alike();
}

/// An upgrade is not a request the lane takes: one the route does not list is refused alike,
/// uncharged, and `h2c` is ignored alike (the upstream is asked no upgrade); the connection
/// then goes on.
#[tokio::test]
async fn an_unlisted_upgrade_answers_alike() {
    let mut p = Pair::start().await;
    let ws = [
        ("x-api-key", KEY),
        ("upgrade", "websocket"),
        ("connection", "upgrade"),
    ];
    let a = p.both(Method::GET, "/v1/orders", &ws).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::FORBIDDEN, "upgrade_not_allowed".into())
    );
    assert!(a.header("ratelimit").is_none(), "{:?}", a.headers);
    let h2c = [
        ("x-api-key", KEY),
        ("upgrade", "h2c"),
        ("connection", "upgrade, http2-settings"),
        ("http2-settings", "AAMAAABkAAQAoAAAAAIAAAAA"),
    ];
    let a = p.both(Method::GET, "/v1/orders", &h2c).await;
    assert_eq!(a.status, StatusCode::OK);
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// TRACE is not a method the lane takes: the express gateway's connection goes to hyper with
/// it, and must answer as `--no-express` does, then go on.
#[tokio::test]
async fn trace_is_refused_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::TRACE, "/v1/orders", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed".into())
    );
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// Unknown and missing keys pay the unauthenticated bucket of three: three `401`s with its
/// budget, then `429`.
#[tokio::test]
async fn unknown_and_missing_keys_answer_alike() {
    let mut p = Pair::start().await;
    let unknown = [("x-api-key", "not-a-key")];
    let a = p.both(Method::GET, "/v1/orders", &unknown).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::UNAUTHORIZED, "unauthorized".into())
    );
    assert!(a.header("ratelimit").is_some(), "{:?}", a.headers);
    let a = p.both(Method::DELETE, "/v1/orders", &unknown).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    let a = p.both(Method::GET, "/v1/orders", &[]).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::UNAUTHORIZED, "unauthorized".into())
    );
    // The bucket is spent.
    let a = p.both(Method::HEAD, "/v1/orders", &[]).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(a.body.is_empty());
    let a = p.both(Method::GET, "/v1/orders", &unknown).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::TOO_MANY_REQUESTS, "rate_limited".into())
    );
    assert!(a.header("retry-after").is_some(), "{:?}", a.headers);
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// A bucket of two: two admitted answers with their budget, then `429` with `Retry-After`,
/// `RateLimit-Policy`, `RateLimit` and a JSON body, to GET, HEAD and DELETE alike.
#[tokio::test]
async fn a_spent_bucket_answers_alike() {
    let mut p = Pair::start().await;
    for left in [1, 0] {
        let a = p.both(Method::GET, "/v1/small", &key()).await;
        assert_eq!(a.status, StatusCode::OK);
        let state = a.header("ratelimit").unwrap_or("");
        assert!(state.contains(&format!(";r={left};")), "{state}");
    }
    let a = p.both(Method::GET, "/v1/small", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::TOO_MANY_REQUESTS, "rate_limited".into())
    );
    for h in ["retry-after", "ratelimit-policy", "ratelimit"] {
        assert!(a.header(h).is_some(), "{h}: {:?}", a.headers);
    }
    let a = p.both(Method::HEAD, "/v1/small", &key()).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(a.body.is_empty());
    let a = p.both(Method::DELETE, "/v1/small", &key()).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// A queueing limit (1 a millisecond, burst 1, a wait of up to 2 ms): the second request waits
/// its millisecond and is forwarded; with two waiting, the next would wait 3 ms and is refused.
/// Each gateway's clock moves only while it has a request waiting, so each waits as long.
#[tokio::test]
async fn a_queued_request_answers_alike() {
    let clocks = [ManualClock::new(at(NOW)), ManualClock::new(at(NOW))];
    let started = std::sync::atomic::AtomicUsize::new(0);
    let given = clocks.clone();
    let mut p = Pair::start_with(move |cfg, _| {
        // The lane's gateway starts first, then hyper's.
        cfg.clock = given[started.fetch_add(1, std::sync::atomic::Ordering::SeqCst)].clone();
    })
    .await;
    let sides = [p.lane.gw.metrics.clone(), p.general.gw.metrics.clone()];
    let mover = tokio::spawn(async move {
        loop {
            for (m, c) in sides.iter().zip(&clocks) {
                if m.queue_waiting.get() > 0 {
                    c.advance_us(100);
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    let a = p.both(Method::GET, "/v1/queued", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    let a = p.both(Method::GET, "/v1/queued", &key()).await;
    assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
    for side in [&p.lane, &p.general] {
        assert_eq!(side.gw.metrics.queued.get(), 1);
    }
    mover.abort();
    // The clocks stand: two more wait for good, and the next would wait 3 ms.
    let holders = p.hold_queued().await;
    let mut more = p.hold_queued().await;
    let a = p.both(Method::GET, "/v1/queued", &key()).await;
    assert_eq!(
        (a.status, error_of(&a), a.header("retry-after")),
        (StatusCode::TOO_MANY_REQUESTS, "rate_limited".into(), Some("1"))
    );
    more.extend(holders);
    for h in more {
        h.abort();
    }
    p.assert_alike();
}

/// A blocking limit: the refusal that starts the block and the ones during it answer alike.
#[tokio::test]
async fn a_blocked_bucket_answers_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/v1/guarded", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    for _ in 0..2 {
        let a = p.both(Method::GET, "/v1/guarded", &key()).await;
        assert_eq!(
            (a.status, error_of(&a), a.header("retry-after")),
            (StatusCode::TOO_MANY_REQUESTS, "blocked".into(), Some("30"))
        );
    }
    let a = p.both(Method::HEAD, "/v1/guarded", &key()).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    p.assert_alike();
}

/// One seat per key: while a slow request holds it, the next gets `429` `too_many_in_flight`.
#[tokio::test]
async fn a_full_seat_limit_answers_alike() {
    let mut p = Pair::start().await;
    let holders = p.hold("/v1/seat?hold").await;
    let a = p.both(Method::GET, "/v1/seat", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::TOO_MANY_REQUESTS, "too_many_in_flight".into())
    );
    assert_eq!(a.header("retry-after"), Some("1"));
    let a = p.both(Method::HEAD, "/v1/seat", &key()).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(a.body.is_empty());
    p.release(holders).await;
    p.assert_alike();
}

/// An upstream that takes one request at a time and queues none: `503` `upstream_overloaded`
/// while one is in flight.
#[tokio::test]
async fn an_overloaded_upstream_answers_alike() {
    let mut p = Pair::start().await;
    let holders = p.hold("/shed?hold").await;
    let a = p.both(Method::GET, "/shed", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::SERVICE_UNAVAILABLE, "upstream_overloaded".into())
    );
    assert_eq!(a.header("retry-after"), Some("1"));
    let a = p.both(Method::HEAD, "/shed", &key()).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(a.body.is_empty());
    p.both(Method::DELETE, "/shed", &key()).await;
    p.release(holders).await;
    p.assert_alike();
}

#[tokio::test]
async fn an_unreachable_upstream_answers_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/down", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::BAD_GATEWAY, "bad_gateway".into())
    );
    let a = p.both(Method::HEAD, "/down", &key()).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert!(a.body.is_empty());
    p.both(Method::DELETE, "/down", &key()).await;
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// An upstream that takes the request and never answers, past its 300 ms: `504`.
#[tokio::test]
async fn an_upstream_past_its_timeout_answers_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/slow?silent", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::GATEWAY_TIMEOUT, "gateway_timeout".into())
    );
    let a = p.both(Method::HEAD, "/slow?silent", &key()).await;
    assert_eq!(a.status, StatusCode::GATEWAY_TIMEOUT);
    assert!(a.body.is_empty());
    let a = p.both(Method::GET, "/slow", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// A limit keyed on a JSON body field, asked without a body: the lane serves such a route
/// itself, and both must refuse it alike.
#[tokio::test]
async fn a_body_field_limit_on_a_bodiless_get_answers_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/v1/accounts", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::BAD_REQUEST, "bad_request".into())
    );
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// The comparisons above mean something only if the express gateway serves those requests on
/// the lane, not handed to hyper. The lane relays an upstream's header names as they came and
/// hyper writes them lowercased, and a connection handed to hyper stays there: so after each
/// refusal the lane takes, an admitted request on the same raw connection still shows `X-Up`.
#[tokio::test]
async fn the_lane_serves_the_refusals_it_is_compared_on() {
    let p = Pair::start().await;
    let refusals = [
        ("/nowhere", KEY, 404),
        ("/../x", KEY, 400),
        ("/v1/orders", "not-a-key", 401),
        ("/v1/orders", "", 401),
        ("/v1/small", KEY, 200),
        ("/v1/small", KEY, 200),
        ("/v1/small", KEY, 429),
        // A limit keyed on a body field, and a post-paid one: begun on the lane, ended there.
        ("/v1/accounts", KEY, 400),
        ("/v1/completions?tokens=5", KEY, 200),
        // Answered by the gateway itself, with a body of its own.
        ("/v1/usage", KEY, 200),
        ("/down", KEY, 502),
        ("/slow?silent", KEY, 504),
    ];
    for (side, upstream_case) in [(&p.lane, "\r\nX-Up: 1\r\n"), (&p.general, "\r\nx-up: 1\r\n")] {
        let mut tcp = TcpStream::connect(side.gw.addr).await.unwrap();
        for (path, secret, status) in refusals {
            let got = raw_get(&mut tcp, path, secret).await;
            assert!(got.starts_with(&format!("HTTP/1.1 {status} ")), "{path}: {got}");
            let next = raw_get(&mut tcp, "/v1/orders", KEY).await;
            assert!(
                next.starts_with("HTTP/1.1 200 ") && next.contains(upstream_case),
                "after {path}, not served as expected ({upstream_case:?}): {next}"
            );
        }
    }
}

/// Sends a GET on a raw keep-alive connection and reads its answer (its body framed by
/// `Content-Length`): the head and body as text.
async fn raw_get(tcp: &mut TcpStream, path: &str, secret: &str) -> String {
    let key = if secret.is_empty() {
        String::new()
    } else {
        format!("X-API-Key: {secret}\r\n")
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: {HOST}\r\nX-Request-Id: {REQUEST_ID}\r\n{key}\r\n");
    tcp.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let read = async {
        let (head, len) = common::raw::read_head(tcp, &mut buf).await?;
        common::raw::read_body(tcp, &mut buf, len)
            .await
            .then(|| [head, buf[..len].to_vec()].concat())
    };
    let got = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the gateway answers")
        .unwrap_or_else(|| panic!("{path}: the gateway closed the connection"));
    String::from_utf8_lossy(&got).into_owned()
}
