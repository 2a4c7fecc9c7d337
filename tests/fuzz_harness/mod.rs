//! The bodies of the fuzz targets in `.fuzz/`, shared with `tests/fuzz_regressions.rs` so a
//! committed seed replays through exactly the code the fuzzer ran.
//!
//! Each entry point takes the raw fuzzer bytes. Nothing reached from here may panic on any
//! input; the few `assert!`s are properties the code promises, not checks of the harness.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::LazyLock;

use arbitrary::{Arbitrary, Unstructured};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use tollgate_gateway::request::{self as gateway, Early};
use tollgate_gateway::respond::{RateFields, Refusal, budget_values};
use tollgate_limit::clock::ManualClock;
use tollgate_limit::decision::decide;
use tollgate_rules::identity::{self, TrustedProxies};
use tollgate_rules::plan;
use tollgate_rules::{self as rules, CompileOptions, Fingerprint, Snapshot};
use tollgate_store::CheckItem;
use tollgate_store::memory::MemoryStore;

/// The name compile errors must carry.
const FILE: &str = "fuzz.json";

/// Target `rules`: arbitrary bytes as a rules file; whatever compiles is summarised as
/// `check-rules` would.
pub fn rules(data: &[u8]) {
    match rules::compile(data, FILE, CompileOptions::default()) {
        Ok(snap) => {
            let text = rules::summary::summary(&snap);
            assert!(text.starts_with("fuzz.json: OK"), "summary head: {text:?}");
        }
        Err(e) => {
            // Every refusal names the file it is about.
            assert_eq!(e.file, FILE);
            assert!(e.to_string().starts_with("fuzz.json: "));
        }
    }
}

/// The demo rules, compiled once per process.
static DEMO: LazyLock<Snapshot> = LazyLock::new(|| {
    rules::compile(
        include_bytes!("../../rules/demo.json"),
        "rules/demo.json",
        CompileOptions::default(),
    )
    .expect("rules/demo.json compiles")
});

/// Trusted-proxy lists a request is classified under: none, some private networks and
/// loopback, and every address (so `X-Forwarded-For` is always read).
/// The wall clock a key's expiry is read on: the demo's keys have none, so it is never read.
static CLOCK: LazyLock<std::sync::Arc<ManualClock>> =
    LazyLock::new(|| ManualClock::new(1_700_000_000_000_000));

static TRUSTED: LazyLock<[TrustedProxies; 3]> = LazyLock::new(|| {
    let parse = |items: &[&str]| {
        let items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
        TrustedProxies::parse(&items).expect("trusted-proxy list")
    };
    [
        TrustedProxies::default(),
        parse(&["10.0.0.0/8", "127.0.0.1", "fd00::/8", "::1"]),
        parse(&["0.0.0.0/0", "::/0"]),
    ]
});

#[derive(Debug, Arbitrary)]
enum Peer {
    V4([u8; 4]),
    V6([u8; 16]),
}

impl Peer {
    fn addr(&self) -> IpAddr {
        match *self {
            Peer::V4(b) => IpAddr::V4(Ipv4Addr::from(b)),
            Peer::V6(b) => IpAddr::V6(Ipv6Addr::from(b)),
        }
    }
}

/// A method: any bytes, or one a route names.
#[derive(Debug, Arbitrary)]
enum Verb {
    Raw(Vec<u8>),
    Known(u8),
}

const METHODS: [&[u8]; 6] = [b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS"];

impl Verb {
    fn bytes(&self) -> &[u8] {
        match self {
            Verb::Raw(b) => b,
            Verb::Known(i) => METHODS[*i as usize % METHODS.len()],
        }
    }
}

/// A path: any text, or a route's prefix with any text after it, so routes beyond the
/// catch-all are reached without spelling their prefixes.
#[derive(Debug, Arbitrary)]
enum Path {
    Raw(String),
    Under(u8, String),
}

impl Path {
    fn text(&self, snap: &Snapshot) -> String {
        match self {
            Path::Raw(s) => s.clone(),
            Path::Under(i, rest) => {
                let prefix = &snap.routes[*i as usize % snap.routes.len()].prefix;
                format!("{prefix}{rest}")
            }
        }
    }
}

/// A header name: any bytes, or one the gateway reads, so a mutation need not spell it.
#[derive(Debug, Arbitrary)]
enum Name {
    Raw(Vec<u8>),
    Known(Known),
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Known {
    Authorization,
    XApiKey,
    XForwardedFor,
    XAccount,
    ContentLength,
    TransferEncoding,
}

impl Name {
    fn bytes(&self) -> &[u8] {
        match self {
            Name::Raw(b) => b,
            Name::Known(k) => match k {
                Known::Authorization => b"authorization",
                Known::XApiKey => b"x-api-key",
                Known::XForwardedFor => b"x-forwarded-for",
                Known::XAccount => b"x-account",
                Known::ContentLength => b"content-length",
                Known::TransferEncoding => b"transfer-encoding",
            },
        }
    }
}

/// The demo rules' secrets (see rules/demo.json). Keys are compared by SHA-256, which no
/// fuzzer inverts, so without these no input would reach the keyed paths.
const SECRETS: [&[u8]; 3] = [b"k7-demo-key", b"k8-demo-key", b"kbig-demo-key"];

/// A header value: any bytes, a demo secret bare (`X-API-Key`) or as a bearer token, or a
/// list of addresses as `X-Forwarded-For` carries them.
#[derive(Debug, Arbitrary)]
enum Value {
    Raw(Vec<u8>),
    Secret(u8),
    Bearer(u8),
    Hops(Vec<Peer>),
}

impl Value {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Value::Raw(b) => b.clone(),
            Value::Secret(i) => SECRETS[*i as usize % SECRETS.len()].to_vec(),
            Value::Bearer(i) => [b"Bearer ", SECRETS[*i as usize % SECRETS.len()]].concat(),
            Value::Hops(hops) => {
                let hops: Vec<String> = hops.iter().map(|p| p.addr().to_string()).collect();
                hops.join(", ").into_bytes()
            }
        }
    }
}

/// One request head as the fuzzer describes it, before the `http` crate validates it.
#[derive(Debug, Arbitrary)]
struct Head {
    method: Verb,
    path: Path,
    headers: Vec<(Name, Value)>,
    peer: Peer,
    trusted: u8,
    /// The route's JSON body field, as the gateway would have read it.
    body_value: Option<Vec<u8>>,
    /// How many times the planned batch is checked, and how far apart in time, so refusals
    /// and refills are reached too.
    checks: u8,
    gap_us: u32,
}

/// Target `classify`: method, path and headers → sanitizer, identity, route, plan, one store
/// check per repeat and the decision with its headers, as `Gateway::route` does them.
pub fn classify(data: &[u8]) {
    let Ok(head) = Head::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let snap = &*DEMO;
    // What the `http` crate refuses to construct never reaches the gateway: its parser
    // validates first. Such a method or URI skips the input.
    let Ok(method) = Method::from_bytes(head.method.bytes()) else {
        return;
    };
    let Ok(uri) = Uri::try_from(head.path.text(snap)) else {
        return;
    };
    let mut headers = HeaderMap::new();
    for (name, value) in &head.headers {
        // A header `http` refuses is dropped alone, so one bad pair doesn't waste the input.
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.bytes()),
            HeaderValue::from_bytes(&value.bytes()),
        ) {
            headers.append(name, value);
        }
    }
    let peer = head.peer.addr();
    let trusted = &TRUSTED[head.trusted as usize % TRUSTED.len()];

    // The pieces on their own, then together as the gateway calls them.
    let _ = tollgate_http1::sanitize::check_head(&headers);
    let _ = identity::credential(&headers);
    let ip = identity::client_ip(peer, &headers, trusted);
    let canonical = identity::canonical(peer);
    if !trusted.contains(canonical) {
        assert_eq!(ip, canonical, "X-Forwarded-For believed from an untrusted peer");
    }

    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = method;
    parts.uri = uri;
    parts.headers = headers;
    // HTTP/1.0, where Host is optional: most inputs don't send one, and should still reach
    // the route, the key and the limiter.
    parts.version = http::Version::HTTP_10;
    let headers = &parts.headers;
    match gateway::classify(snap, &parts, peer, Fingerprint::None, trusted, &**CLOCK) {
        Ok((c, _)) => {
            assert_eq!(c.ip, ip);
            let route = &snap.routes[c.route];
            let key = c.key.map(|k| k.0);
            if let Ok(batch) = plan::build(
                snap,
                route,
                key,
                c.ip,
                c.fingerprint,
                headers,
                head.body_value.as_deref(),
            ) {
                check(snap, &batch, key, &head);
            }
        }
        Err(Early::Refuse(r)) => {
            let _ = r.into_response();
        }
        Err(Early::Unauthorized { ip, .. }) => {
            check(snap, &plan::unauthenticated_only(snap, ip), None, &head);
        }
    }
}

/// Checks a batch on a fresh embedded store (so runs don't depend on earlier inputs) and
/// reads each outcome as the gateway does.
fn check(snap: &Snapshot, batch: &[CheckItem], key: Option<usize>, head: &Head) {
    for item in batch {
        // A bucket name has exactly one hash tag, whatever the header values held.
        let tags = (item.key.matches('{').count(), item.key.matches('}').count());
        assert_eq!(tags, (1, 1), "bucket name {:?}", item.key);
    }
    if batch.is_empty() {
        return;
    }
    let start = 1_700_000_000_000_000;
    let store = MemoryStore::new(ManualClock::new(start));
    for i in 0..=u64::from(head.checks % 25) {
        let now = start + i * u64::from(head.gap_us);
        let outcome = store.check_at(batch, now);
        let d = decide(batch, &outcome);
        assert_eq!(d.admitted(), outcome.admitted);
        assert!(d.deciding.is_none_or(|i| i < batch.len()));
        let mut resp = if d.admitted() {
            http::Response::new(())
        } else {
            let limit = snap.deciding_limit(batch, &d).unwrap_or_default().to_string();
            let retry_after = d.retry_after();
            Refusal::RateLimited {
                limit,
                retry_after,
                blocked: d.blocked,
            }
            .into_response()
            .map(drop)
        };
        let caller = key.map_or(
            tollgate_rules::plan::Caller::Anonymous,
            tollgate_rules::plan::Caller::Key,
        );
        let fields = RateFields {
            budget: budget_values(snap, batch, caller, &d),
            quota: None,
        };
        fields.apply(resp.headers_mut());
    }
}
