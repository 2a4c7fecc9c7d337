//! Forwarding to upstreams: kept connections, the upstream's header edits (hop-by-hop
//! stripping, the secret swapped for the key's id, `X-Forwarded-*`, `Forwarded` and `X-Real-IP`
//! from trusted proxies only, no method overrides), and 502/504 for upstreams that refuse,
//! reset or stall.

pub mod body;
pub mod client;
pub mod names;
pub mod pool;
pub mod targets;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Response, Uri, Version};

use crate::respond::{Refusal, UpBody};
use tollgate_http1::method_override;
use tollgate_rules::Upstream;
use tollgate_rules::identity::{KeySource, X_API_KEY};

pub(crate) use tollgate_http1::HOP_BY_HOP;

pub(crate) static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(crate) static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub(crate) static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// The client's address as the proxy in front saw it: believed from a trusted proxy only.
pub(crate) static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
/// A client's promise that sending its request twice does no harm (the IETF's
/// `Idempotency-Key`): such a request may go to another target after one failed it.
pub(crate) static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The authenticated key's public id, for the upstream; never the secret.
pub(crate) static X_TOLLGATE_KEY_ID: HeaderName = HeaderName::from_static("x-tollgate-key-id");
pub(crate) static X_TOLLGATE_TENANT: HeaderName = HeaderName::from_static("x-tollgate-tenant");

/// The header names the `Connection` headers list, which are hop-by-hop too.
fn connection_named(headers: &HeaderMap) -> smallvec::SmallVec<[HeaderName; 2]> {
    let mut named = smallvec::SmallVec::new();
    for v in headers.get_all(header::CONNECTION) {
        for n in tollgate_http1::connection_tokens(v.as_bytes()) {
            // `keep-alive` and `close` are the usual values, and name nothing else to drop.
            if n.eq_ignore_ascii_case(b"keep-alive") || n.eq_ignore_ascii_case(b"close") {
                continue;
            }
            if let Ok(name) = HeaderName::from_bytes(n) {
                named.push(name);
            }
        }
    }
    named
}

/// Where a request comes from, as the upstream is told: its peer, whether that peer is a trusted
/// proxy, the scheme the client used, and the key that authenticated it.
#[derive(Debug, Clone)]
pub(crate) struct Provenance {
    /// The TCP peer, its IPv4-mapped addresses as IPv4.
    pub peer: std::net::IpAddr,
    /// Whether the peer is a trusted proxy whose `X-Forwarded-*` we keep.
    pub peer_trusted: bool,
    /// `http` or `https`, as the client reached us.
    pub proto: &'static str,
    /// The authenticated key: its id and tenant headers, and where its secret came from.
    pub key: Option<(HeaderValue, HeaderValue, KeySource)>,
}

/// Forwards requests to upstreams, each over its own keep-alive connections.
#[derive(Clone)]
pub(crate) struct Proxy {
    /// The longest wait for a client's next request-body bytes; past it, 408.
    pub body_timeout: std::time::Duration,
}

impl Default for Proxy {
    fn default() -> Proxy {
        Proxy {
            body_timeout: std::time::Duration::from_secs(10),
        }
    }
}

impl Proxy {
    pub fn new() -> Proxy {
        Proxy::default()
    }

    /// hyper's exchange: sends the request in `ask` (its head already retargeted) with the
    /// client's body streamed behind it, and reads the answer's head into hyper's response.
    /// Nothing is buffered whole. Every wait on the upstream is bounded by its timeout, every
    /// wait on the client's body by [`Proxy::body_timeout`]. The body is borrowed: what of it
    /// the exchange left unread is the caller's to settle with the client. `tried` says where
    /// it went, as [`client::exchange`] keeps it up.
    pub(crate) async fn exchange(
        &self,
        ask: &Ask<'_>,
        head: &[u8],
        body: &mut UpBody,
        tried: &mut client::Attempted,
    ) -> Result<Exchanged<Response<()>>, client::Failure> {
        use http_body::Body as _;
        let parts = ask.parts;
        let has_body = !body.is_end_stream();
        let chunked = chunked(parts, body);
        let is_head = parts.method == http::Method::HEAD;
        let outgoing = has_body.then_some(client::Outgoing {
            body,
            chunked,
            timeout: self.body_timeout,
        });
        let asked = tollgate_http1::response::Asked {
            head: is_head,
            upgrade: ask.upgrade,
        };
        let (conn, (resp, shape, reported), attempted) = client::exchange(
            ask.targets,
            ask.picking,
            head,
            outgoing,
            ask.idempotent,
            asked,
            Some(ask.upstream.timeout),
            tried,
            |h| (response_parts(h, is_head, ask.ours), h.shape(), ask.capture(h)),
        )
        .await?;
        let head = resp.ok_or(client::Failure::Unforwardable(
            tollgate_http1::response::Unforwardable("a header hyper can't hold"),
        ))?;
        Ok(Exchanged {
            conn,
            shape,
            head,
            reported,
            attempted,
        })
    }
}

/// What an exchange with an upstream needs, on either path.
pub(crate) struct Ask<'a> {
    pub upstream: &'a Upstream,
    /// Its targets, and what choosing one needs of the request.
    pub targets: &'a targets::Targets,
    pub picking: targets::Picking,
    /// Whether it may go again after a target took it and failed: its method is idempotent,
    /// or it carries an `Idempotency-Key`.
    pub idempotent: bool,
    /// The request's head, retargeted at the upstream.
    pub parts: &'a http::request::Parts,
    /// The route's largest request body.
    pub max_body: u64,
    /// Whether the gateway writes `RateLimit-Policy` and `RateLimit` itself, so the upstream's
    /// are dropped.
    pub ours: bool,
    /// Whether the answer's headers are kept for a post-paid debit.
    pub post_paid: bool,
    /// Whether the request holds a limited place or a seat, which a client that hangs up
    /// should give back without waiting for the upstream.
    pub holds: bool,
    /// The protocol the request upgrades to, which the route allows: its `101` is the answer.
    pub upgrade: Option<&'a str>,
}

impl Ask<'_> {
    /// The answer's headers, kept for a post-paid debit; `None` on other routes.
    pub(crate) fn capture(&self, h: &tollgate_http1::response::Head<'_>) -> Option<Box<HeaderMap>> {
        if !self.post_paid {
            return None;
        }
        let mut map = HeaderMap::with_capacity(h.headers.len());
        for x in h.headers {
            if let (Ok(n), Some(v)) = (
                HeaderName::from_bytes(x.name.as_bytes()),
                client::header_value(x.value),
            ) {
                map.append(n, v);
            }
        }
        Some(Box::new(map))
    }
}

/// Whether a request's body goes upstream chunked: it has one, of no declared length (HTTP/2
/// without `content-length`, or a chunked HTTP/1 body, which hyper decoded).
pub(crate) fn chunked(parts: &http::request::Parts, body: &UpBody) -> bool {
    !http_body::Body::is_end_stream(body) && !parts.headers.contains_key(header::CONTENT_LENGTH)
}

/// An upstream's answer, its head read: the connection positioned at its body, how the body
/// is framed, the head as the wire keeps it, and the headers a post-paid debit reads.
pub(crate) struct Exchanged<H> {
    pub conn: pool::RawConn,
    pub shape: tollgate_http1::response::Shape,
    pub head: H,
    pub reported: Option<Box<HeaderMap>>,
    /// The target whose connection this is, and the attempts it took.
    pub attempted: client::Attempted,
}

/// Whether an upstream's header is one of the rate-limit fields the gateway writes itself.
pub(crate) fn rate_field(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"ratelimit") || name.eq_ignore_ascii_case(b"ratelimit-policy")
}

/// hyper's response for an upstream's judged head: the forwarded headers, with the length left
/// to the body's size (hyper writes it from there), except for HEAD, where only the header
/// can say it.
fn response_parts(h: &tollgate_http1::response::Head<'_>, is_head: bool, ours: bool) -> Option<Response<()>> {
    let build = || {
        let mut resp = Response::new(());
        *resp.status_mut() = http::StatusCode::from_u16(h.status).ok()?;
        let map = resp.headers_mut();
        map.reserve(h.headers.len());
        for x in h.headers {
            let name = x.name.as_bytes();
            if !h.forwards(name) || (ours && rate_field(name)) {
                continue;
            }
            map.append(HeaderName::from_bytes(name).ok()?, client::header_value(x.value)?);
        }
        if let (true, Some(n)) = (is_head, h.length) {
            map.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        Some(resp)
    };
    build()
}

/// The gateway's answer when an exchange with `up` failed, the same on both paths: it names the
/// upstream by its name in the rules; the address and the OS's error go to the log only.
pub(crate) fn failure_answer(up: &Upstream, failure: &client::Failure) -> Refusal {
    use client::Failure as F;
    tracing::debug!(upstream = &*up.name, authority = %up.authority, error = %failure, "upstream failed");
    let name = &*up.name;
    match failure {
        F::Unreachable(_) => Refusal::BadGateway(format!("upstream {name:?} could not be reached")),
        F::Closed { .. } => Refusal::BadGateway(format!(
            "upstream {name:?} closed the connection before answering"
        )),
        F::Unforwardable(_) => Refusal::BadGateway(format!(
            "upstream {name:?} sent a response the gateway can't forward"
        )),
        F::TimedOut => Refusal::GatewayTimeout(format!("upstream {name:?} did not answer in time")),
        F::EarlyBytes => Refusal::BadGateway(format!(
            "upstream {name:?} sent bytes before the request was written"
        )),
        F::ClientStalled => Refusal::RequestTimeout,
        // Nobody is left to read it; the status is for the log.
        F::ClientGone => Refusal::BadRequest("the client closed its connection".into()),
        F::ClientBody(e) => match e.downcast_ref::<body::TooLarge>() {
            Some(t) => Refusal::PayloadTooLarge { limit: t.0 },
            None => Refusal::BadRequest(format!("the request body failed: {e}")),
        },
    }
}

/// Points the request target at the upstream: origin form (the connection already names the
/// upstream, and `Host` says it again), under its path prefix.
pub(crate) fn retarget(up: &Upstream, parts: &mut http::request::Parts) -> Result<(), Refusal> {
    parts.version = Version::HTTP_11;
    let u = &parts.uri;
    if up.path_prefix.is_empty()
        && u.scheme().is_none()
        && u.authority().is_none()
        && u.path_and_query().is_some()
    {
        return Ok(());
    }
    let path_and_query = match (up.path_prefix.is_empty(), parts.uri.path_and_query()) {
        (true, Some(pq)) => pq.clone(),
        (_, pq) => {
            let pq = pq.map_or("/", |p| p.as_str());
            let mut joined = String::with_capacity(up.path_prefix.len() + pq.len());
            joined.push_str(&up.path_prefix);
            joined.push_str(pq);
            PathAndQuery::from_maybe_shared(joined)
                .map_err(|e| Refusal::BadRequest(format!("request target can't be forwarded: {e}")))?
        }
    };
    let mut target = http::uri::Parts::default();
    target.path_and_query = Some(path_and_query);
    parts.uri = Uri::from_parts(target)
        .map_err(|e| Refusal::BadRequest(format!("request target can't be forwarded: {e}")))?;
    Ok(())
}

/// An address as a header value. IPv4 by hand: `Display` for `Ipv4Addr` goes through the
/// formatting machinery, about 1,500 instructions a request (callgrind) for 15 bytes.
fn ip_value(ip: std::net::IpAddr) -> HeaderValue {
    let std::net::IpAddr::V4(v4) = ip else {
        return HeaderValue::try_from(ip.to_string()).unwrap_or_else(|_| HeaderValue::from_static("unknown"));
    };
    let mut text = [0u8; 15];
    let mut n = 0;
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            text[n] = b'.';
            n += 1;
        }
        if octet >= 100 {
            text[n] = b'0' + octet / 100;
            n += 1;
        }
        if octet >= 10 {
            text[n] = b'0' + octet / 10 % 10;
            n += 1;
        }
        text[n] = b'0' + octet % 10;
        n += 1;
    }
    HeaderValue::from_bytes(&text[..n]).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

/// Every value of `name` in `headers` joined in one line, with `ours` after them; `None` when
/// the client sent none.
fn appended(headers: &HeaderMap, name: &HeaderName, ours: &[u8]) -> Option<HeaderValue> {
    let mut v = Vec::new();
    for prior in headers.get_all(name) {
        v.extend_from_slice(prior.as_bytes());
        v.extend_from_slice(b", ");
    }
    if v.is_empty() {
        return None;
    }
    v.extend_from_slice(ours);
    HeaderValue::from_bytes(&v).ok()
}

/// This hop's `Forwarded` element (RFC 7239): `for=` the address the request came from, an
/// IPv6 one quoted and in brackets as the grammar asks.
fn forwarded_for_element(ip: std::net::IpAddr, text: &HeaderValue) -> Vec<u8> {
    let mut e = b"for=".to_vec();
    if ip.is_ipv6() {
        e.extend_from_slice(b"\"[");
        e.extend_from_slice(text.as_bytes());
        e.extend_from_slice(b"]\"");
    } else {
        e.extend_from_slice(text.as_bytes());
    }
    e
}

/// How the client's headers become the upstream's: hop-by-hop headers (and those `Connection`
/// names), the secret, any client-sent `X-Tollgate-*` and method override headers are dropped,
/// and so are `Forwarded` and `X-Real-IP` unless a trusted proxy sent them; the caller's
/// identity, `X-Forwarded-*` and `Host` are set. One description for both paths: hyper's edits a header
/// map with it, the express lane writes the upstream's head from it directly.
pub(crate) struct HeaderEdits {
    connection_named: smallvec::SmallVec<[HeaderName; 2]>,
    credential: Option<KeySource>,
    /// Whether the peer is a trusted proxy, whose `Forwarded` and `X-Real-IP` go on.
    peer_trusted: bool,
    /// Headers set, replacing any the client sent under the same names.
    pub set: smallvec::SmallVec<[(HeaderName, HeaderValue); 8]>,
}

impl HeaderEdits {
    pub fn new(up: &Upstream, parts: &http::request::Parts, from: Provenance) -> HeaderEdits {
        let h = &parts.headers;
        let mut set = smallvec::SmallVec::new();
        let credential = from.key.as_ref().map(|k| k.2);
        if let Some((id, tenant, _)) = from.key {
            // The upstream learns who called from us, not from the secret.
            set.push((X_TOLLGATE_KEY_ID.clone(), id));
            set.push((X_TOLLGATE_TENANT.clone(), tenant));
        }
        // Written per request rather than kept per connection: an idle connection holds less.
        let peer = ip_value(from.peer);
        // A trusted proxy's hops go on with ours after them, every line of them as the client
        // address was read from (`identity::client_ip`), in one line; anyone else's are
        // dropped, so the upstream reads no address a client made up.
        let forwarded_for = if from.peer_trusted {
            let element = forwarded_for_element(from.peer, &peer);
            if let Some(v) = appended(h, &header::FORWARDED, &element) {
                set.push((header::FORWARDED, v));
            }
            appended(h, &X_FORWARDED_FOR, peer.as_bytes()).unwrap_or(peer)
        } else {
            peer
        };
        set.push((X_FORWARDED_FOR.clone(), forwarded_for));
        if !from.peer_trusted || !h.contains_key(&X_FORWARDED_PROTO) {
            set.push((X_FORWARDED_PROTO.clone(), HeaderValue::from_static(from.proto)));
        }
        if !from.peer_trusted || !h.contains_key(&X_FORWARDED_HOST) {
            let original_host = h.get(header::HOST).cloned().or_else(|| {
                parts
                    .uri
                    .authority()
                    .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
            });
            if let Some(host) = original_host {
                set.push((X_FORWARDED_HOST.clone(), host));
            }
        }
        set.push((header::HOST, up.host_header.clone()));
        HeaderEdits {
            connection_named: connection_named(h),
            credential,
            peer_trusted: from.peer_trusted,
            set,
        }
    }

    /// Whether a client header of this name goes upstream unchanged.
    pub fn keeps(&self, name: &HeaderName) -> bool {
        let secret = match self.credential {
            None => false,
            Some(KeySource::Bearer) => name == header::AUTHORIZATION,
            Some(KeySource::ApiKeyHeader) => name == X_API_KEY,
            Some(KeySource::Both) => name == header::AUTHORIZATION || name == X_API_KEY,
        };
        !(secret
            || HOP_BY_HOP.contains(name)
            || name == X_TOLLGATE_KEY_ID
            || name == X_TOLLGATE_TENANT
            || (!self.peer_trusted && (name == header::FORWARDED || name == X_REAL_IP))
            || method_override::named(name)
            || self.connection_named.contains(name)
            || self.set.iter().any(|(n, _)| n == name))
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn addresses_are_written_as_display_writes_them() {
        use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
        let mut v4: Vec<Ipv4Addr> = vec![
            Ipv4Addr::new(0, 0, 0, 0),
            Ipv4Addr::new(255, 255, 255, 255),
            Ipv4Addr::new(10, 0, 100, 9),
            Ipv4Addr::new(127, 0, 0, 1),
            Ipv4Addr::new(192, 168, 1, 250),
        ];
        // Every octet value in every position.
        v4.extend((0..=255u8).map(|o| Ipv4Addr::new(o, 255 - o, o / 2, o.wrapping_mul(7))));
        for a in v4 {
            assert_eq!(ip_value(IpAddr::V4(a)).to_str().unwrap(), a.to_string());
        }
        let v6 = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
        assert_eq!(ip_value(IpAddr::V6(v6)).to_str().unwrap(), "2001:db8::1");
    }
    use super::*;

    #[test]
    fn strips_hop_by_hop_and_connection_named() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("keep-alive, x-secret-hop"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        let up = tollgate_rules::compile(
            br#"{"version": 1, "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
                "routes": [{"method": "GET", "path": "/", "upstream": "u", "key": "optional"}]}"#,
            "test.json",
            tollgate_rules::CompileOptions::default(),
        )
        .unwrap()
        .upstreams
        .remove(0);
        let (mut parts, ()) = http::Request::new(()).into_parts();
        parts.headers = h;
        let from = Provenance {
            peer: std::net::Ipv4Addr::LOCALHOST.into(),
            peer_trusted: false,
            proto: "http",
            key: None,
        };
        let edits = HeaderEdits::new(&up, &parts, from);
        let kept: Vec<&str> = parts
            .headers
            .keys()
            .filter(|n| edits.keeps(n))
            .map(|n| n.as_str())
            .collect();
        assert_eq!(kept, ["x-kept"]);
    }
}
