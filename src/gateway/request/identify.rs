//! Who is asking and for what: the head checked and classified against the rules (route, key,
//! client IP, method), before anything is charged.

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;

use http::HeaderValue;
use tollgate_http1::path::{EncodedSlashes, PathError, canonical, has_encoded_slash};
use tollgate_http1::{method_override, sanitize};
use tollgate_keys::Verdict;
use tollgate_limit::clock::Clock;
use tollgate_limit::decision::Decision;
use tollgate_rules::identity::{KeySource, TrustedProxies};
use tollgate_rules::jwt::{JwtCaller, TokenError};
use tollgate_rules::{
    Fingerprint, Identity, KeyCheck, KeyRequirement, Snapshot, hash_secret, identity, plan,
};
use tollgate_telemetry::metrics::Handles;

use super::Gateway;
use super::begin::Facts;
use crate::proxy::Provenance;
use crate::request::{Begun, deciding_name, rate_limited, with_budget};
use crate::respond::{Answer, Refusal};
use crate::server::ConnInfo;

/// What a request head says against the rules, before any I/O.
#[derive(Debug, Clone)]
pub struct Classified {
    pub route: usize,
    /// The authenticated key and where its secret came from.
    pub key: Option<(usize, KeySource)>,
    /// The verified token's caller, on a JWT route.
    pub jwt: Option<Arc<JwtCaller>>,
    /// The TCP peer.
    pub peer: IpAddr,
    /// The client address the limits key on.
    pub ip: IpAddr,
    /// The connection's client fingerprint.
    pub fingerprint: Fingerprint,
    /// The method a POST's override asked for, on a route that honours it: routed, limited
    /// and forwarded in place of the client's.
    pub method: Option<http::Method>,
}

impl Classified {
    /// Whose buckets the request pays.
    pub fn caller(&self) -> plan::Caller<'_> {
        match (&self.jwt, self.key) {
            (Some(j), _) => plan::Caller::Jwt(j),
            (None, Some((k, _))) => plan::Caller::Key(k),
            (None, None) => plan::Caller::Anonymous,
        }
    }
}

/// A request answered before any limit is checked.
#[derive(Debug)]
pub enum Early {
    Refuse(Refusal),
    /// No usable key: the unauthenticated bucket of `ip` decides between 401 and 429.
    Unauthorized {
        route: Option<usize>,
        ip: IpAddr,
        why: Refusal,
    },
}

/// Reads a request head against a snapshot: framing, method, host and path checks, the route,
/// the client address and the key; `fingerprint` is its connection's, `clock` the wall clock a
/// key's expiry is read on (only for a key that has one). Pure, so it can be fuzzed.
///
/// Routing is on the canonical path; when that differs from the client's spelling it comes
/// back too, and the caller forwards it (see [`set_path`]), so the upstream serves exactly the
/// path that was limited.
pub fn classify(
    snap: &Snapshot,
    parts: &http::request::Parts,
    peer: IpAddr,
    fingerprint: Fingerprint,
    trusted: &TrustedProxies,
    clock: &dyn Clock,
) -> Result<(Classified, Option<String>), Early> {
    let headers = &parts.headers;
    check_head(parts)?;
    let path = canonical(parts.uri.path(), EncodedSlashes::Keep).map_err(|e| bad(&e))?;
    // Read only when some route honours overrides: otherwise they are just dropped (`edits`).
    let overridden = if snap.method_override && parts.method == http::Method::POST {
        overriding_method(snap, headers, &path).map_err(|e| bad(&e))?
    } else {
        None
    };
    let route = route_of(snap, overridden.as_ref().unwrap_or(&parts.method), &path)?;
    let ip = identity::client_ip(peer, headers, trusted);
    let (key, jwt) = caller_of(snap, route, headers, ip, clock)?;
    let rewritten = match path {
        Cow::Owned(p) => Some(p),
        Cow::Borrowed(_) => None,
    };
    Ok((
        Classified {
            route,
            key,
            jwt,
            peer,
            ip,
            fingerprint,
            method: overridden,
        },
        rewritten,
    ))
}

fn bad(e: &dyn std::fmt::Display) -> Early {
    Early::Refuse(Refusal::BadRequest(e.to_string()))
}

/// What a head must be before its path is read: clean headers, a method that is not CONNECT
/// and is spelled as the standard spells it, an `http`/`https` target, one sound Host.
fn check_head(parts: &http::request::Parts) -> Result<(), Early> {
    let method = &parts.method;
    sanitize::check_head(&parts.headers).map_err(|e| bad(&e))?;
    if *method == http::Method::CONNECT {
        return Err(Early::Refuse(Refusal::MethodNotAllowed(
            "CONNECT: the gateway is not a tunnel",
        )));
    }
    if let Some(standard) = sanitize::miscased_method(method) {
        return Err(bad(&format_args!(
            "methods are case-sensitive: {:?} is not {standard}",
            method.as_str()
        )));
    }
    // An absolute-form target names where to send the request; a gateway for HTTP serves
    // only `http` and `https`, whatever else it would route the path to.
    if let Some(scheme) = parts.uri.scheme()
        && *scheme != http::uri::Scheme::HTTP
        && *scheme != http::uri::Scheme::HTTPS
    {
        return Err(bad(&format_args!(
            "the request target's scheme {:?} is not http or https",
            scheme.as_str()
        )));
    }
    sanitize::check_host(parts.version, &parts.uri, &parts.headers).map_err(|e| bad(&e))
}

/// The route a method and canonical path take, or why none does.
fn route_of(snap: &Snapshot, method: &http::Method, path: &str) -> Result<usize, Early> {
    let route = match snap.route(method, path) {
        Some(r) => r,
        None if *method == http::Method::TRACE => {
            return Err(Early::Refuse(Refusal::MethodNotAllowed(
                "TRACE is served only by a route that names it",
            )));
        }
        // Refused as it would be on a route that doesn't keep them, not a 404 that tells
        // a prober nothing about why.
        None if has_encoded_slash(path) => return Err(bad(&PathError::EncodedSlash)),
        None => return Err(Early::Refuse(Refusal::NotFound)),
    };
    if snap.routes[route].encoded_slashes == EncodedSlashes::Refuse && has_encoded_slash(path) {
        return Err(bad(&PathError::EncodedSlash));
    }
    Ok(route)
}

/// The key a request authenticated with, or its verified token's caller; neither when anonymous.
type Caller = (Option<(usize, KeySource)>, Option<Arc<JwtCaller>>);

/// Who calls, as the route asks them to prove it: a verified token on a JWT route, else a known
/// key (or none, where the route lets the unauthenticated bucket decide).
fn caller_of(
    snap: &Snapshot,
    route: usize,
    headers: &http::HeaderMap,
    ip: IpAddr,
    clock: &dyn Clock,
) -> Result<Caller, Early> {
    let unauthorized = |why| Early::Unauthorized {
        route: Some(route),
        ip,
        why,
    };
    let credential = identity::credential(headers).map_err(|e| bad(&e))?;
    if snap.routes[route].identity == Identity::Jwt {
        let token = match credential {
            Some((token, KeySource::Bearer | KeySource::Both)) => token,
            _ => return Err(unauthorized(Refusal::BadToken(TokenError::Missing))),
        };
        let caller = snap
            .verify_jwt(&snap.routes[route], token)
            .map_err(|e| unauthorized(Refusal::BadToken(e)))?;
        return Ok((None, Some(Arc::new(caller))));
    }
    let refused = |reason, message| unauthorized(Refusal::Unauthorized { reason, message });
    let key = match credential {
        None => None,
        // A secret in the form the admin API makes, with a wrong checksum (a typo, a cut
        // paste), is no key's: refused before any lookup.
        Some((secret, _)) if tollgate_keys::secret::looks_generated(secret) == Verdict::BadChecksum => {
            return Err(refused("unknown_key", "unknown API key"));
        }
        Some((secret, source)) => match snap
            .keys
            .check(&hash_secret(secret), || clock.now_us() / 1_000_000)
        {
            Some(KeyCheck::Valid(k)) => Some((k, source)),
            Some(KeyCheck::Expired(_)) => {
                return Err(refused("key_expired", "this API key or secret has expired"));
            }
            Some(KeyCheck::Revoked(_)) => return Err(refused("key_revoked", "this API key was revoked")),
            None => return Err(refused("unknown_key", "unknown API key")),
        },
    };
    if key.is_none() && snap.routes[route].key == KeyRequirement::Required {
        return Err(refused(
            "missing_key",
            "this route needs an API key (Authorization: Bearer or X-API-Key)",
        ));
    }
    Ok((key, None))
}

/// The method a POST's override headers ask for when the route that method takes honours
/// overrides; `None` when it has none or that route doesn't. A value that names no method is
/// refused where some route of the path honours overrides, and only dropped elsewhere.
pub(super) fn overriding_method(
    snap: &Snapshot,
    headers: &http::HeaderMap,
    path: &str,
) -> Result<Option<http::Method>, method_override::BadOverride> {
    let honours = |m: &http::Method| {
        snap.route(m, path)
            .is_some_and(|r| snap.routes[r].method_override)
    };
    match method_override::requested(headers) {
        Ok(Some(m)) if honours(&m) => Ok(Some(m)),
        Ok(_) => Ok(None),
        Err(e) => {
            use http::Method as M;
            let methods = [M::GET, M::POST, M::PUT, M::PATCH, M::DELETE, M::OPTIONS];
            if methods.iter().any(honours) {
                Err(e)
            } else {
                Ok(None)
            }
        }
    }
}

/// Puts a canonical path in place of the client's, keeping the query byte for byte.
pub(crate) fn set_path(uri: &mut http::Uri, path: String) -> Result<(), Refusal> {
    let mut pq = path;
    // From the '?' on, as the client sent it, even an empty query.
    if let Some(q) = uri
        .path_and_query()
        .and_then(|pq| pq.as_str().find('?').map(|i| &pq.as_str()[i..]))
    {
        pq.push_str(q);
    }
    let unforwardable =
        |e: &dyn std::fmt::Display| Refusal::BadRequest(format!("request target can't be forwarded: {e}"));
    let mut p = std::mem::take(uri).into_parts();
    p.path_and_query = Some(http::uri::PathAndQuery::from_maybe_shared(pq).map_err(|e| unforwardable(&e))?);
    *uri = http::Uri::from_parts(p).map_err(|e| unforwardable(&e))?;
    Ok(())
}

impl Gateway {
    /// The first step of every request, on either path: its head read against the rules
    /// (framing, method, `Host`, canonical path, route, caller). On success the request's path
    /// is the canonical one, which is what the upstream will get, and an HTTP/2 request's
    /// authority is its `Host`. A request without a usable key is answered here, after paying
    /// its address's unauthenticated bucket.
    pub(crate) async fn identify(
        &self,
        b: &mut Begun<'_>,
        parts: &mut http::request::Parts,
        conn: &ConnInfo,
    ) -> Result<Classified, Answer> {
        // Disjoint borrows of the request's state, not clones of its `Arc`s.
        let (snap, live, facts) = (&*b.snap, &*b.live, &mut b.facts);
        let peer = identity::canonical(conn.peer.ip());
        let classified = classify(snap, parts, peer, conn.fingerprint, &self.trusted, &*self.clock);
        if let Some(r) = &mut facts.access {
            r.client_ip = match &classified {
                Ok((c, _)) => Some(c.ip),
                Err(Early::Unauthorized { ip, .. }) => Some(*ip),
                Err(Early::Refuse(_)) => None,
            };
        }
        let (c, path) = match classified {
            Ok(c) => c,
            Err(Early::Refuse(r)) => return Err(r.into()),
            Err(Early::Unauthorized { route, ip, why }) => {
                facts.route = route;
                if let Some(r) = &mut facts.access {
                    // The path it was routed on, as the usual request's is after `set_path`.
                    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                    let (path, query) = pq.split_at(pq.find('?').unwrap_or(pq.len()));
                    let routed = canonical(path, EncodedSlashes::Keep).unwrap_or(Cow::Borrowed(path));
                    r.set_path(format!("{routed}{query}").as_bytes());
                }
                // Boxed, like every rare path here: an async fn's future is as large as its
                // largest state, and the common path should not carry (and copy) that size.
                return Err(Box::pin(self.unauthorized(snap, ip, why, &live.handles, facts)).await);
            }
        };
        if let Some(p) = path {
            set_path(&mut parts.uri, p).map_err(Answer::from)?;
        }
        if let Some(r) = &mut facts.access {
            r.set_path(parts.uri.path_and_query().map_or("/", |p| p.as_str()).as_bytes());
        }
        if let Some(m) = &c.method {
            parts.method = m.clone();
        }
        // Only a target with an authority (HTTP/2's, or an absolute form) can lack a Host, so
        // the usual request looks at one field, not the header map.
        if let Some(host) = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
            && !parts.headers.contains_key(http::header::HOST)
        {
            parts.headers.insert(http::header::HOST, host);
        }
        facts.route = Some(c.route);
        facts.key_id = match &c.jwt {
            Some(j) => Some(j.id.clone()),
            None => c.key.map(|(k, _)| snap.keys[k].id.clone()),
        };
        Ok(c)
    }

    /// A request without a usable key pays the unauthenticated bucket of its IP: a refused one
    /// gets 429, so guessing keys is limited too; an admitted one gets 401.
    pub(super) async fn unauthorized(
        &self,
        snap: &Snapshot,
        ip: IpAddr,
        why: Refusal,
        h: &Handles,
        facts: &mut Facts,
    ) -> Answer {
        let batch = plan::unauthenticated_only(snap, ip);
        if batch.is_empty() {
            return why.into();
        }
        let d = match self.check(snap, h, &batch, batch.len(), facts).await {
            Err(_) => return Refusal::LimiterUnavailable.into(),
            Ok((d, _)) => d,
        };
        let refusal = match &d {
            Decision::Unavailable(_) => return Refusal::LimiterUnavailable.into(),
            Decision::Admitted(_) => why,
            Decision::Limited(..) => {
                facts.limit = deciding_name(snap, &batch, &d);
                rate_limited(snap, &batch, &d)
            }
        };
        with_budget(
            refusal,
            crate::respond::budget_values(snap, &batch, plan::Caller::Anonymous, &d),
        )
    }

    pub(super) fn provenance<'a>(
        &self,
        snap: &'a Snapshot,
        c: &'a Classified,
        conn: &'a ConnInfo,
    ) -> Provenance {
        Provenance {
            peer: tollgate_rules::identity::canonical(conn.peer.ip()),
            peer_trusted: !self.trusted.is_empty() && self.trusted.contains(c.peer),
            proto: conn.proto,
            key: match (&c.jwt, c.key) {
                (Some(j), _) => Some((j.id_header.clone(), j.tenant_header.clone(), KeySource::Bearer)),
                (None, Some((k, src))) => Some((snap.keys[k].id_header(), snap.keys[k].tenant_header(), src)),
                (None, None) => None,
            },
        }
    }
}
