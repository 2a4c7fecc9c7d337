//! Forwarding to upstreams: a pooled client, hop-by-hop stripping, `X-Forwarded-*`, and 502/504
//! for upstreams that refuse, reset or stall.

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
static HOP_BY_HOP: [HeaderName; 9] = [
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
    for v in headers.get_all(header::CONNECTION) {
        for n in v.to_str().unwrap_or("").split(',') {
            let n = n.trim();
            // `keep-alive` and `close` are the usual values, and name nothing else to drop.
            if n.eq_ignore_ascii_case("keep-alive") || n.eq_ignore_ascii_case("close") || n.is_empty() {
                continue;
            }
            if let Ok(name) = HeaderName::from_bytes(n.as_bytes()) {
                found.push(name);
            }
        }
    }
    for n in found {
        headers.remove(n);
    }
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
        mut req: Request<UpBody>,
        caller: Caller<'_>,
    ) -> Result<Response<Incoming>, Refusal> {
        let original_host = req.headers().get(header::HOST).cloned().or_else(|| {
            req.uri()
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        let path_and_query = match (up.path_prefix.is_empty(), req.uri().path_and_query()) {
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
        // Origin form: the connection already names the upstream, and `Host` says it again.
        let mut target = http::uri::Parts::default();
        target.path_and_query = Some(path_and_query);
        *req.uri_mut() = Uri::from_parts(target)
            .map_err(|e| Refusal::BadRequest(format!("request target can't be forwarded: {e}")))?;
        *req.version_mut() = Version::HTTP_11;

        let h = req.headers_mut();
        strip_hop_by_hop(h);
        h.remove(&X_TOLLGATE_KEY_ID);
        h.remove(&X_TOLLGATE_TENANT);
        if let Some((id, tenant, source)) = caller.key {
            // The upstream learns who called from us, not from the secret.
            match source {
                KeySource::Bearer => {
                    h.remove(header::AUTHORIZATION);
                }
                KeySource::ApiKeyHeader => {
                    h.remove(X_API_KEY);
                }
                KeySource::Both => {
                    h.remove(header::AUTHORIZATION);
                    h.remove(X_API_KEY);
                }
            }
            h.insert(X_TOLLGATE_KEY_ID.clone(), id.clone());
            h.insert(X_TOLLGATE_TENANT.clone(), tenant.clone());
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
        h.insert(X_FORWARDED_FOR.clone(), forwarded_for);
        if !caller.peer_trusted || !h.contains_key(&X_FORWARDED_PROTO) {
            h.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static(caller.proto));
        }
        if (!caller.peer_trusted || !h.contains_key(&X_FORWARDED_HOST))
            && let Some(host) = original_host
        {
            h.insert(X_FORWARDED_HOST.clone(), host);
        }
        h.insert(header::HOST, up.host_header.clone());

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
