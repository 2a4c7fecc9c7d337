//! Forwarding to upstreams: kept connections, the upstream's header edits (hop-by-hop
//! stripping, the secret swapped for the key's id, `X-Forwarded-*`), and 502/504 for upstreams
//! that refuse, reset or stall.

pub mod body;
pub mod pool;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;

use crate::identity::{KeySource, X_API_KEY};
use crate::respond::{Refusal, UpBody};
use crate::rules::Upstream;

/// Headers that describe one connection, not the message (RFC 9110 7.6.1), so a proxy never
/// forwards them.
pub(crate) static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
];

pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// The authenticated key's public id, for the upstream; never the secret.
pub static X_TOLLGATE_KEY_ID: HeaderName = HeaderName::from_static("x-tollgate-key-id");
pub static X_TOLLGATE_TENANT: HeaderName = HeaderName::from_static("x-tollgate-tenant");

/// Removes hop-by-hop headers, including every header the `Connection` header names.
///
/// Runs twice per request, so it first looks for any of them in one pass over the names
/// (comparing known names is cheap) and removes only what it found.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let mut found: smallvec::SmallVec<[HeaderName; 4]> = headers
        .keys()
        .filter(|k| HOP_BY_HOP.contains(k))
        .cloned()
        .collect();
    if found.is_empty() {
        return;
    }
    found.extend(connection_named(headers));
    for n in found {
        headers.remove(n);
    }
}

/// The header names the `Connection` headers list, which are hop-by-hop too.
fn connection_named(headers: &HeaderMap) -> smallvec::SmallVec<[HeaderName; 2]> {
    let mut named = smallvec::SmallVec::new();
    for v in headers.get_all(header::CONNECTION) {
        for n in v.to_str().unwrap_or("").split(',') {
            let n = n.trim();
            // `keep-alive` and `close` are the usual values, and name nothing else to drop.
            if n.eq_ignore_ascii_case("keep-alive") || n.eq_ignore_ascii_case("close") || n.is_empty() {
                continue;
            }
            if let Ok(name) = HeaderName::from_bytes(n.as_bytes()) {
                named.push(name);
            }
        }
    }
    named
}

/// What the proxy needs to know about the caller.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    /// The TCP peer, as a header value.
    pub peer: &'a HeaderValue,
    /// Whether the peer is a trusted proxy whose `X-Forwarded-*` we keep.
    pub peer_trusted: bool,
    /// `http` or `https`, as the client reached us.
    pub proto: &'static str,
    /// The authenticated key: its id and tenant headers, and where its secret came from.
    pub key: Option<(&'a HeaderValue, &'a HeaderValue, KeySource)>,
}

/// Forwards requests to upstreams, each over its own keep-alive connections.
#[derive(Clone, Default)]
pub struct Proxy;

impl Proxy {
    pub fn new() -> Proxy {
        Proxy
    }

    /// Sends `req` to `up` and returns its response with hop-by-hop headers removed. The
    /// bodies stream both ways; nothing is buffered whole.
    pub async fn forward(
        &self,
        up: &Upstream,
        req: Request<UpBody>,
        caller: Caller<'_>,
    ) -> Result<Response<Incoming>, Refusal> {
        let (mut parts, body) = req.into_parts();
        prepare(up, &mut parts, caller)?;
        let req = Request::from_parts(parts, body);
        let mut resp = match tokio::time::timeout(up.timeout, up.pool.send(req)).await {
            Err(_) => return Err(Refusal::GatewayTimeout),
            Ok(Err(e)) => {
                let what = match &e {
                    pool::SendError::Connect(_) => format!("upstream {:?} refused the connection", &*up.name),
                    pool::SendError::Failed(_) => {
                        format!("upstream {:?} closed the connection before answering", &*up.name)
                    }
                };
                tracing::debug!(upstream = &*up.name, error = %e, "upstream failed");
                return Err(Refusal::BadGateway(what));
            }
            Ok(Ok(r)) => r,
        };
        strip_hop_by_hop(resp.headers_mut());
        Ok(resp)
    }
}

/// Rewrites a client's request head into the one an upstream gets: origin-form target under
/// the upstream's path prefix, and the header edits of [`HeaderEdits`].
pub fn prepare(up: &Upstream, parts: &mut http::request::Parts, caller: Caller<'_>) -> Result<(), Refusal> {
    let edits = HeaderEdits::new(up, parts, caller);
    retarget(up, parts)?;
    let h = &mut parts.headers;
    let dropped: smallvec::SmallVec<[HeaderName; 8]> =
        h.keys().filter(|n| !edits.keeps(n)).cloned().collect();
    for name in dropped {
        h.remove(name);
    }
    for (name, value) in edits.set {
        h.insert(name, value);
    }
    Ok(())
}

/// Points the request target at the upstream: origin form (the connection already names the
/// upstream, and `Host` says it again), under its path prefix.
pub fn retarget(up: &Upstream, parts: &mut http::request::Parts) -> Result<(), Refusal> {
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

/// How the client's headers become the upstream's: hop-by-hop headers (and those `Connection`
/// names), the secret and any client-sent `X-Tollgate-*` are dropped; the caller's identity,
/// `X-Forwarded-*` and `Host` are set. One description for both paths: hyper's edits a header
/// map with it, the express lane writes the upstream's head from it directly.
pub struct HeaderEdits {
    connection_named: smallvec::SmallVec<[HeaderName; 2]>,
    credential: Option<KeySource>,
    /// Headers set, replacing any the client sent under the same names.
    pub set: smallvec::SmallVec<[(HeaderName, HeaderValue); 8]>,
}

impl HeaderEdits {
    pub fn new(up: &Upstream, parts: &http::request::Parts, caller: Caller<'_>) -> HeaderEdits {
        let h = &parts.headers;
        let mut set = smallvec::SmallVec::new();
        if let Some((id, tenant, _)) = caller.key {
            // The upstream learns who called from us, not from the secret.
            set.push((X_TOLLGATE_KEY_ID.clone(), id.clone()));
            set.push((X_TOLLGATE_TENANT.clone(), tenant.clone()));
        }
        let peer = caller.peer.clone();
        let forwarded_for = match (caller.peer_trusted, h.get(&X_FORWARDED_FOR)) {
            (true, Some(prior)) => {
                let mut v = prior.as_bytes().to_vec();
                v.extend_from_slice(b", ");
                v.extend_from_slice(peer.as_bytes());
                HeaderValue::from_bytes(&v).unwrap_or(peer)
            }
            _ => peer,
        };
        set.push((X_FORWARDED_FOR.clone(), forwarded_for));
        if !caller.peer_trusted || !h.contains_key(&X_FORWARDED_PROTO) {
            set.push((X_FORWARDED_PROTO.clone(), HeaderValue::from_static(caller.proto)));
        }
        if !caller.peer_trusted || !h.contains_key(&X_FORWARDED_HOST) {
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
            credential: caller.key.map(|k| k.2),
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
            || self.connection_named.contains(name)
            || self.set.iter().any(|(n, _)| n == name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_hop_by_hop_and_connection_named() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("keep-alive, x-secret-hop"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }
}
