//! The `routes` of a rules file: paths and methods, what each costs in which limit, the
//! body field a limit keys on, and what an unauthenticated request may do.

use std::collections::{HashMap, HashSet};

use http::Method;
use tollgate_http1::path;
use tollgate_http1::path::EncodedSlashes;

use crate::compile::{Compiler, Limits, Upstreams, slashes};
use crate::raw::{RawRoute, RawRules, RawServe};
use crate::{
    DEFAULT_IDLE_TIMEOUT_MS, DEFAULT_MAX_BODY_BYTES, Dimension, Identity, KeyRequirement, Keys, Limit,
    Numbers, Route, RulesError, Serves,
};

/// The protocols a route may upgrade to, lowercase.
type Protocols = Box<[Box<str>]>;

impl Compiler<'_> {
    pub(super) fn routes(
        &self,
        raw: &RawRules,
        upstreams: &Upstreams,
        limits: &Limits,
        keys: &Keys,
    ) -> Result<Vec<Route>, RulesError> {
        let mut routes: Vec<Route> = Vec::new();
        let mut seen = HashMap::new();
        // A set, not a look through the routes so far: 10,000 routes made that 50 million
        // name compares per load.
        let mut names = HashSet::new();
        for (i, r) in raw.routes.iter().enumerate() {
            let field = format!("routes[{i}]");
            let method = if r.method == "*" {
                None
            } else {
                Some(self.route_method(&field, &r.method)?)
            };
            self.route_path(&field, &r.path)?;
            if r.method_override
                && let Some(m) = method.as_ref().filter(|m| {
                    !matches!(
                        **m,
                        Method::GET
                            | Method::POST
                            | Method::PUT
                            | Method::PATCH
                            | Method::DELETE
                            | Method::OPTIONS
                    )
                })
            {
                // A POST may only become a method whose answer it can be sent (not HEAD's,
                // which has no body) and that no route should be reached by through a header.
                return Err(self.err(
                    format!("{field}.method_override"),
                    format!(
                        "a POST can't be overridden into {m}: only GET, POST, PUT, PATCH, DELETE and OPTIONS"
                    ),
                ));
            }
            if r.identity == Identity::Jwt && r.key == KeyRequirement::Optional {
                return Err(self.err(
                    format!("{field}.key"),
                    "a JWT route needs its token: \"optional\" applies to API keys only",
                ));
            }
            let serves = self.serves(&field, r, raw, upstreams)?;
            let name = r
                .name
                .clone()
                .unwrap_or_else(|| format!("{} {}", r.method, r.path));
            if let Some(prev) = seen.insert((r.method.clone(), r.path.clone()), i) {
                return Err(self.err(&field, format!("same method and path as routes[{prev}]")));
            }
            if !names.insert(name.clone()) {
                return Err(self.err(format!("{field}.name"), format!("duplicate route name {name:?}")));
            }
            let (upgrade, idle_timeout) = self.upgrades(&field, r, serves, method.as_ref())?;
            let costs = self.costs(&field, r, &name, limits, keys)?;
            let body_field = self.body_field(&field, &costs, &limits.list)?;
            let post_paid = costs
                .iter()
                .any(|&(li, _)| limits.list[li as usize].post_paid.is_some());
            // A usage route has no upstream to take these from: its paths are matched exactly
            // and refuse encoded slashes, as an upstream's do by default.
            let (up_slashes, case_insensitive) = match serves {
                Serves::Upstream(u) => (
                    upstreams.list[u].encoded_slashes,
                    upstreams.list[u].case_insensitive,
                ),
                Serves::Usage => (EncodedSlashes::default(), false),
            };
            routes.push(Route {
                post_paid,
                name: name.into(),
                body_field,
                method,
                prefix: r.path.clone(),
                serves,
                key: r.key,
                identity: r.identity,
                costs,
                max_body_bytes: r.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
                encoded_slashes: slashes(r.encoded_slashes).unwrap_or(up_slashes),
                case_insensitive,
                method_override: r.method_override,
                upgrade,
                idle_timeout,
            });
        }
        Ok(routes)
    }

    /// The protocols a route's requests may upgrade to, and how long an upgraded connection may
    /// stay silent.
    fn upgrades(
        &self,
        field: &str,
        r: &RawRoute,
        serves: Serves,
        method: Option<&Method>,
    ) -> Result<(Protocols, std::time::Duration), RulesError> {
        let mut protocols: Vec<Box<str>> = Vec::with_capacity(r.upgrade.len());
        for (j, p) in r.upgrade.iter().enumerate() {
            let at = format!("{field}.upgrade[{j}]");
            // A protocol is a token, with an optional `/version` (RFC 9110 §7.8).
            let token = |t: &str| !t.is_empty() && t.bytes().all(tollgate_http1::is_tchar);
            let valid = match p.split_once('/') {
                Some((name, version)) => token(name) && token(version),
                None => token(p),
            };
            if !valid {
                return Err(self.err(
                    at,
                    format!("{p:?} is not a protocol name (letters, digits and !#$%&'*+-.^_`|~, with an optional /version)"),
                ));
            }
            let lower = p.to_ascii_lowercase();
            if lower == "h2c" {
                return Err(self.err(
                    at,
                    "h2c is HTTP/2's own upgrade, which the gateway does not relay: clients reach it over HTTP/2 directly (with prior knowledge, or TLS and ALPN)",
                ));
            }
            if protocols.iter().any(|q| **q == *lower) {
                return Err(self.err(at, format!("{p:?} is listed twice")));
            }
            protocols.push(lower.into());
        }
        if !protocols.is_empty() {
            if serves == Serves::Usage {
                return Err(self.err(
                    format!("{field}.upgrade"),
                    "a usage route answers itself and has no upstream to relay an upgraded connection to",
                ));
            }
            if protocols.iter().any(|p| &**p == "websocket") && method.is_some_and(|m| *m != Method::GET) {
                return Err(self.err(
                    format!("{field}.upgrade"),
                    format!(
                        "a WebSocket opening handshake is a GET, so a route of {} never sees one: use \"method\": \"GET\"",
                        method.map_or("*", |m| m.as_str())
                    ),
                ));
            }
        }
        let idle = match r.idle_timeout_ms {
            None => DEFAULT_IDLE_TIMEOUT_MS,
            Some(_) if protocols.is_empty() => {
                return Err(self.err(
                    format!("{field}.idle_timeout_ms"),
                    "applies to upgraded connections only, and this route takes no upgrade: add \"upgrade\": [\"websocket\"] or remove it",
                ));
            }
            Some(0) => {
                return Err(self.err(
                    format!("{field}.idle_timeout_ms"),
                    "must be at least 1: an upgraded connection can't be closed before it may speak",
                ));
            }
            Some(ms) => ms,
        };
        Ok((protocols.into(), std::time::Duration::from_millis(idle)))
    }

    /// Where a route's requests go: its upstream, or, for `"serve": "usage"`, the gateway's own
    /// answer, which forwards nothing and reads the budget of an API key that must be sent.
    fn serves(
        &self,
        field: &str,
        r: &RawRoute,
        raw: &RawRules,
        upstreams: &Upstreams,
    ) -> Result<Serves, RulesError> {
        let known = || raw.upstreams.keys().collect::<Vec<_>>();
        match (r.serve, &r.upstream) {
            (Some(RawServe::Usage), Some(u)) => Err(self.err(
                format!("{field}.upstream"),
                format!(
                    "a usage route (\"serve\": \"usage\") forwards nothing: it answers with the caller's budget itself, so it takes no upstream (remove \"upstream\": {u:?})"
                ),
            )),
            (Some(RawServe::Usage), None) if r.identity == Identity::Jwt => Err(self.err(
                format!("{field}.identity"),
                "a usage route answers with an API key's own budget; a JWT caller has no key in the rules to answer for (use \"identity\": \"key\")",
            )),
            (Some(RawServe::Usage), None) if r.key == KeyRequirement::Optional => Err(self.err(
                format!("{field}.key"),
                "a usage route answers with the caller's key's budget, so it needs the key: leave \"key\" out or write \"required\"",
            )),
            (Some(RawServe::Usage), None) => Ok(Serves::Usage),
            (None, None) => Err(self.err(
                format!("{field}.upstream"),
                format!(
                    "a route needs the upstream it forwards to (known: {:?}), or \"serve\": \"usage\" to answer itself",
                    known()
                ),
            )),
            (None, Some(u)) => match upstreams.by_name.get(u) {
                Some(&i) => Ok(Serves::Upstream(i)),
                None => Err(self.err(
                    format!("{field}.upstream"),
                    format!("no upstream named {u:?} (known: {:?})", known()),
                )),
            },
        }
    }

    pub(super) fn route_path(&self, field: &str, path: &str) -> Result<(), RulesError> {
        if !path.starts_with('/') {
            return Err(self.err(format!("{field}.path"), format!("{path:?} must start with '/'")));
        }
        // Requests are routed on canonical paths, so a prefix spelled any other way would
        // never match.
        match path::canonical(path, EncodedSlashes::Keep) {
            Ok(c) if c == path => Ok(()),
            Ok(c) => Err(self.err(
                format!("{field}.path"),
                format!("{path:?} is not in canonical form; write {c:?}"),
            )),
            Err(e) => Err(self.err(format!("{field}.path"), format!("{path:?}: {e}"))),
        }
    }

    /// A route's (limit index, cost) pairs. A charge no request could pay (above a burst,
    /// the limit's own or a key's, or in a limit with no numbers for some key) is refused
    /// at load rather than failing every request.
    pub(super) fn costs(
        &self,
        field: &str,
        r: &RawRoute,
        name: &str,
        limits: &Limits,
        keys: &Keys,
    ) -> Result<Vec<(u16, u64)>, RulesError> {
        let mut costs = Vec::new();
        for (lname, &cost) in &r.cost {
            let cfield = format!("{field}.cost.{lname}");
            let Some(&li) = limits.by_name.get(lname.as_str()) else {
                return Err(self.err(&cfield, format!("no limit named {lname:?}")));
            };
            if cost == 0 {
                return Err(self.err(&cfield, "a cost must be at least 1; leave the limit out instead"));
            }
            let limit = &limits.list[li];
            if let Some(pp) = &limit.post_paid
                && cost != pp.reserve
            {
                return Err(self.err(
                    &cfield,
                    format!(
                        "limit {lname:?} is post-paid: a request pays its reserve ({}) up front and the rest when the answer reports it; write {}",
                        pp.reserve, pp.reserve
                    ),
                ));
            }
            if r.identity == Identity::Jwt {
                self.jwt_cost(&cfield, name, lname, limit, cost)?;
                costs.push((li as u16, cost));
                continue;
            }
            if let Dimension::Claim(c) = &limit.dimension {
                return Err(self.err(
                    &cfield,
                    format!("limit {lname:?} keys on the JWT claim {c:?}, but route {name:?} takes API keys (\"identity\": \"jwt\" to take tokens)"),
                ));
            }
            if limit.concurrent.is_some() {
                if cost != 1 {
                    return Err(self.err(
                        &cfield,
                        "a request takes one seat of a limit on requests in flight; write 1",
                    ));
                }
                costs.push((li as u16, cost));
                continue;
            }
            // `who` is called only for the error: this runs for every key of every route.
            let check = |n: &Numbers, who: &dyn Fn() -> String| {
                if cost > n.params.burst {
                    Err(self.err(
                        &cfield,
                        format!(
                            "route {name:?} costs {cost} in limit {lname:?}, above its burst {}{}: it could never pass",
                            n.params.burst,
                            who()
                        ),
                    ))
                } else {
                    Ok(())
                }
            };
            if let Some(n) = &limit.numbers {
                check(n, &String::new)?;
            }
            // The admin API's keys follow the file's: an error in one names its own field.
            let first_managed = keys.len() - self.managed.len();
            let key_field = |ki: usize| match ki.checked_sub(first_managed) {
                Some(m) => format!("managed_keys[{m}].limits.{lname}"),
                None => format!("keys[{ki}].limits.{lname}"),
            };
            for ki in 0..keys.len() {
                match keys.numbers(ki, limit, li) {
                    Some(n) if keys[ki].managed && cost > n.params.burst => {
                        return Err(self.err(
                            format!("{}.burst", key_field(ki)),
                            format!(
                                "route {name:?} costs {cost} in limit {lname:?}, above this key's burst {}: it could never pass",
                                n.params.burst
                            ),
                        ));
                    }
                    Some(n) => check(n, &|| format!(" for key {:?}", keys[ki].id))?,
                    None if r.key == KeyRequirement::Required || limit.dimension == Dimension::Key => {
                        return Err(self.err(
                            key_field(ki),
                            format!(
                                "limit {lname:?} has no numbers of its own and key {:?} sets none, but route {name:?} charges it",
                                keys[ki].id
                            ),
                        ));
                    }
                    None => {}
                }
            }
            costs.push((li as u16, cost));
        }
        Ok(costs)
    }

    /// A JWT route's cost in one limit: payable under every plan, and in limits a token's
    /// caller can pay (its numbers come from the limit or its plans, never from a key).
    pub(super) fn jwt_cost(
        &self,
        cfield: &str,
        name: &str,
        lname: &str,
        limit: &Limit,
        cost: u64,
    ) -> Result<(), RulesError> {
        if limit.concurrent.is_some() {
            return Err(self.err(
                cfield,
                format!("limit {lname:?} counts requests in flight per API key; a JWT route can't charge it"),
            ));
        }
        if limit.dimension == Dimension::Key && limit.numbers.is_none() && limit.plans.is_none() {
            return Err(self.err(
                cfield,
                format!("limit {lname:?} has no numbers of its own and no \"plans\", so a token's caller has none, but route {name:?} charges it"),
            ));
        }
        let all = limit
            .numbers
            .iter()
            .map(|n| ("".to_string(), n))
            .chain(limit.plans.iter().flat_map(|p| {
                p.numbers
                    .iter()
                    .map(|(plan, n)| (format!(" for plan {plan:?}"), n))
            }));
        for (who, n) in all {
            if cost > n.params.burst {
                return Err(self.err(
                    cfield,
                    format!("route {name:?} costs {cost} in limit {lname:?}, above its burst {}{who}: it could never pass", n.params.burst),
                ));
            }
        }
        Ok(())
    }

    /// The JSON body field a route's limits are keyed on, if any.
    pub(super) fn body_field(
        &self,
        field: &str,
        costs: &[(u16, u64)],
        limits: &[Limit],
    ) -> Result<Option<String>, RulesError> {
        let mut body_fields: Vec<&String> = costs
            .iter()
            .filter_map(|&(li, _)| match &limits[li as usize].dimension {
                Dimension::BodyField(f) => Some(f),
                _ => None,
            })
            .collect();
        body_fields.dedup();
        if body_fields.len() > 1 {
            return Err(self.err(
                format!("{field}.cost"),
                format!("limits keyed on different body fields {body_fields:?}; one route can read one"),
            ));
        }
        Ok(body_fields.first().map(|f| f.to_string()))
    }

    pub(super) fn unauthenticated(
        &self,
        raw: &RawRules,
        limits: &Limits,
    ) -> Result<Option<(u16, u64)>, RulesError> {
        let Some(u) = &raw.unauthenticated else {
            return Ok(None);
        };
        let Some(&li) = limits.by_name.get(u.limit.as_str()) else {
            return Err(self.err("unauthenticated.limit", format!("no limit named {:?}", u.limit)));
        };
        let limit = &limits.list[li];
        if limit.dimension != Dimension::Ip {
            return Err(self.err(
                "unauthenticated.limit",
                format!("limit {:?} must have dimension \"ip\"", u.limit),
            ));
        }
        if u.cost == 0 {
            return Err(self.err("unauthenticated.cost", "must be at least 1"));
        }
        if let Some(n) = &limit.numbers
            && u.cost > n.params.burst
        {
            return Err(self.err(
                "unauthenticated.cost",
                format!(
                    "cost {} is above the burst {} of limit {:?}",
                    u.cost, n.params.burst, u.limit
                ),
            ));
        }
        Ok(Some((li as u16, u.cost)))
    }

    /// A route's method: a token the way clients must send it. A lower-case `post` would match
    /// no request (those are refused), and CONNECT is never routed.
    pub(super) fn route_method(&self, field: &str, text: &str) -> Result<Method, RulesError> {
        let m = Method::from_bytes(text.as_bytes()).map_err(|_| {
            self.err(
                format!("{field}.method"),
                format!("{text:?} is not an HTTP method (or \"*\")"),
            )
        })?;
        if m == Method::CONNECT {
            return Err(self.err(
                format!("{field}.method"),
                "CONNECT is refused with 405: the gateway is not a tunnel",
            ));
        }
        if let Some(standard) = tollgate_http1::sanitize::miscased_method(&m) {
            return Err(self.err(
                format!("{field}.method"),
                format!("methods are case-sensitive: write {standard:?}, not {text:?}"),
            ));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{base, err};

    #[test]
    fn a_path_must_start_with_a_slash() {
        let mut rules = base();
        rules["routes"][0]["path"] = "v1".into();
        let e = err(&rules);
        assert_eq!(e.field, "routes[0].path", "{e}");
    }

    #[test]
    fn two_routes_with_one_method_and_path_are_refused() {
        let mut rules = base();
        let again = rules["routes"][0].clone();
        rules["routes"].as_array_mut().unwrap().push(again);
        let e = err(&rules);
        assert!(e.reason.contains("same method and path as routes[0]"), "{e}");
    }

    #[test]
    fn a_usage_route_takes_no_upstream_and_needs_a_key() {
        use crate::{KeyRequirement, Serves};
        let mut rules = base();
        rules["routes"][0]["serve"] = "usage".into();
        let e = err(&rules);
        assert_eq!(e.field, "routes[0].upstream", "{e}");
        assert!(
            e.reason
                .contains("a usage route (\"serve\": \"usage\") forwards nothing"),
            "{e}"
        );
        rules["routes"][0].as_object_mut().unwrap().remove("upstream");
        let snap = super::super::testing::ok(&rules);
        assert_eq!(snap.routes[0].serves, Serves::Usage);
        assert_eq!(snap.routes[0].key, KeyRequirement::Required);
        let mut optional = rules.clone();
        optional["routes"][0]["key"] = "optional".into();
        let e = err(&optional);
        assert_eq!(e.field, "routes[0].key", "{e}");
        let mut jwt = rules.clone();
        jwt["routes"][0]["identity"] = "jwt".into();
        let e = err(&jwt);
        assert_eq!(e.field, "routes[0].identity", "{e}");
        assert!(e.reason.contains("a JWT caller has no key"), "{e}");
        let mut forward = rules;
        forward["routes"][0].as_object_mut().unwrap().remove("serve");
        let e = err(&forward);
        assert_eq!(e.field, "routes[0].upstream", "{e}");
        assert!(e.reason.contains("or \"serve\": \"usage\""), "{e}");
    }

    #[test]
    fn a_route_to_an_unknown_upstream_is_refused() {
        let mut rules = base();
        rules["routes"][0]["upstream"] = "nowhere".into();
        let e = err(&rules);
        assert_eq!(e.field, "routes[0].upstream", "{e}");
    }
}
