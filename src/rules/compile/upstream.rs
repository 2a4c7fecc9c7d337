//! The `upstreams` of a rules file: where each is, how it is reached (TLS), and its
//! limits on requests in flight.

use std::collections::HashMap;
use std::time::Duration;

use http::HeaderValue;
use http::uri::Authority;

use crate::compile::{Compiler, Upstreams, slashes};
use crate::raw::{
    RawBalance, RawConcurrency, RawEject, RawHealth, RawPathMatch, RawRetries, RawRules, RawTarget,
    RawUpstream, RawUpstreamTls,
};
use crate::{
    Balance, ConcurrencyBounds, DEFAULT_CONCURRENCY_MAX, DEFAULT_CONCURRENCY_MIN, DEFAULT_IDLE_TIMEOUT,
    DEFAULT_QUEUE_TIMEOUT, DEFAULT_UPSTREAM_TIMEOUT, Eject, Health, KeyRequirement, MAX_CONCURRENCY,
    MAX_EJECTION, Retries, Route, RulesError, Serves, Target, Upstream, UpstreamTls, tls,
};

/// The largest weight of a target: weights say shares, and a share of a million is plenty.
const MAX_WEIGHT: u32 = 1_000_000;

/// The shortest time between two lookups of a target's name: more often only loads the
/// resolver.
const MIN_DNS_REFRESH_MS: u64 = 100;

/// How often a target's name is resolved again by default.
const DEFAULT_DNS_REFRESH: Duration = Duration::from_secs(5);

/// The most retries of one request: each is another target's time.
const MAX_RETRIES: u32 = 10;

/// One target's URL as written, before it is read: where it was given (for errors), and the
/// weight and limit in flight given with it.
struct TargetUrl<'u> {
    field: String,
    url: &'u str,
    weight: u32,
    max_in_flight: Option<u32>,
}

impl Compiler<'_> {
    pub(super) fn upstreams(&self, raw: &RawRules) -> Result<Upstreams, RulesError> {
        let mut upstreams = Upstreams {
            list: Vec::new(),
            by_name: HashMap::new(),
        };
        for (name, u) in &raw.upstreams {
            let upstream = self.upstream(name, u)?;
            upstreams.by_name.insert(name.clone(), upstreams.list.len());
            upstreams.list.push(upstream);
        }
        Ok(upstreams)
    }

    pub(super) fn upstream(&self, name: &str, u: &RawUpstream) -> Result<Upstream, RulesError> {
        let field = format!("upstreams.{name}");
        let urls = self.target_urls(&field, u)?;
        let targets = self.targets(&urls)?;
        let (uri, scheme, authority) = self.base_url(&urls[0].field, urls[0].url)?;
        let https = scheme == http::uri::Scheme::HTTPS;
        let eject = self.eject(&field, u.eject.as_ref())?;
        let prefix = uri.path().trim_end_matches('/');
        let health = match &u.health {
            Some(h) => Some(self.health(&field, prefix, h)?),
            None => None,
        };
        let retries = self.retries(&field, u.retries.as_ref())?;
        let balance = match u.balance {
            RawBalance::LeastRequest => Balance::LeastRequest,
            RawBalance::RoundRobin => Balance::RoundRobin,
            RawBalance::Hash => Balance::Hash,
        };
        let tls = self.tls_if_https(&field, https, &authority, u.tls.as_ref(), urls[0].url)?;
        let path_prefix = uri.path().trim_end_matches('/').to_string();
        let timeout = self.above_zero_ms(&field, "timeout_ms", u.timeout_ms, DEFAULT_UPSTREAM_TIMEOUT)?;
        if u.max_in_flight == Some(0) {
            return Err(self.err(format!("{field}.max_in_flight"), "must be above zero"));
        }
        let queue_timeout = u
            .queue_timeout_ms
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_QUEUE_TIMEOUT);
        let host_header = HeaderValue::from_str(authority.as_str())
            .map_err(|_| self.err(urls[0].field.clone(), "the host can't be a Host header"))?;
        let idle_timeout =
            self.above_zero_ms(&field, "idle_timeout_ms", u.idle_timeout_ms, DEFAULT_IDLE_TIMEOUT)?;
        let dns_refresh = self.dns_refresh(&field, u.dns_refresh_ms)?;
        let adaptive = match &u.concurrency {
            Some(c) => self.concurrency(&field, c, u.max_in_flight)?,
            None => None,
        };
        Ok(Upstream {
            idle_timeout,
            adaptive,
            name: name.into(),
            scheme,
            authority,
            tls,
            path_prefix,
            timeout,
            max_in_flight: u.max_in_flight,
            queue_timeout,
            host_header,
            encoded_slashes: slashes(u.encoded_slashes).unwrap_or_default(),
            case_insensitive: u.paths == RawPathMatch::CaseInsensitive,
            targets,
            balance,
            health,
            eject,
            retries,
            dns_refresh,
        })
    }

    /// An upstream's target URLs, from its one `url` or its `targets`, each with its weight and
    /// limit in flight; the URLs themselves are read later, all together, as one target's
    /// must agree with the first's.
    fn target_urls<'u>(&self, field: &str, u: &'u RawUpstream) -> Result<Vec<TargetUrl<'u>>, RulesError> {
        match (&u.url, &u.targets) {
            (Some(url), None) => Ok(vec![TargetUrl {
                field: format!("{field}.url"),
                url: url.as_str(),
                weight: 1,
                max_in_flight: None,
            }]),
            (None, Some(targets)) if targets.is_empty() => {
                Err(self.err(format!("{field}.targets"), "must name at least one target"))
            }
            (None, Some(targets)) => targets
                .iter()
                .enumerate()
                .map(|(i, t)| self.target_url(&format!("{field}.targets[{i}]"), t, u.max_in_flight))
                .collect(),
            (Some(_), Some(_)) => {
                Err(self.err(format!("{field}.targets"), "give `url` or `targets`, not both"))
            }
            (None, None) => Err(self.err(
                format!("{field}.url"),
                "missing: an upstream needs `url` or `targets`",
            )),
        }
    }

    /// One entry of `targets`, at `at`: its weight and its own limit in flight, which excludes
    /// the upstream's.
    fn target_url<'u>(
        &self,
        at: &str,
        t: &'u RawTarget,
        upstream_max_in_flight: Option<u32>,
    ) -> Result<TargetUrl<'u>, RulesError> {
        if t.max_in_flight == Some(0) {
            return Err(self.err(format!("{at}.max_in_flight"), "must be above zero"));
        }
        if t.max_in_flight.is_some() && upstream_max_in_flight.is_some() {
            return Err(self.err(
                format!("{at}.max_in_flight"),
                "give max_in_flight on the upstream or on its targets, not both: the upstream's is then the sum of its targets'",
            ));
        }
        match t.weight {
            Some(0) => Err(self.err(format!("{at}.weight"), "must be at least 1")),
            Some(w) if w > MAX_WEIGHT => {
                Err(self.err(format!("{at}.weight"), format!("must be at most {MAX_WEIGHT}")))
            }
            w => Ok(TargetUrl {
                field: format!("{at}.url"),
                url: t.url.as_str(),
                weight: w.unwrap_or(1),
                max_in_flight: t.max_in_flight,
            }),
        }
    }

    /// The targets at `urls`: one scheme and path prefix for all, since a request's path is
    /// written once whichever target takes it, and no host twice.
    fn targets(&self, urls: &[TargetUrl<'_>]) -> Result<Vec<Target>, RulesError> {
        let mut targets = Vec::with_capacity(urls.len());
        let mut first = None;
        for TargetUrl {
            field: url_field,
            url,
            weight,
            max_in_flight,
        } in urls
        {
            let (uri, scheme, authority) = self.base_url(url_field, url)?;
            if let Some((scheme0, path0)) = &first {
                if *scheme0 != scheme || uri.path().trim_end_matches('/') != path0 {
                    return Err(self.err(
                        url_field.clone(),
                        format!("{url:?}: every target has the scheme and path prefix of the first"),
                    ));
                }
            } else {
                first = Some((scheme.clone(), uri.path().trim_end_matches('/').to_string()));
            }
            if targets.iter().any(|t: &Target| t.authority == authority) {
                return Err(self.err(url_field.clone(), format!("{url:?} is named twice")));
            }
            targets.push(Target {
                authority,
                weight: *weight,
                max_in_flight: *max_in_flight,
            });
        }
        Ok(targets)
    }

    /// TLS settings for an `https://` upstream; a plain one given them is refused, as they
    /// would silently do nothing.
    fn tls_if_https(
        &self,
        field: &str,
        https: bool,
        authority: &Authority,
        raw: Option<&RawUpstreamTls>,
        first_url: &str,
    ) -> Result<Option<UpstreamTls>, RulesError> {
        match (https, raw) {
            (true, t) => Ok(Some(self.upstream_tls(field, authority, t)?)),
            (false, None) => Ok(None),
            (false, Some(_)) => Err(self.err(
                format!("{field}.tls"),
                format!("{first_url:?} is http://: only an https:// upstream takes TLS settings"),
            )),
        }
    }

    /// A duration in ms at `{field}.{name}`, `default` when not given; zero would time out
    /// everything at once.
    fn above_zero_ms(
        &self,
        field: &str,
        name: &str,
        ms: Option<u64>,
        default: Duration,
    ) -> Result<Duration, RulesError> {
        match ms {
            Some(0) => Err(self.err(format!("{field}.{name}"), "must be above zero")),
            Some(ms) => Ok(Duration::from_millis(ms)),
            None => Ok(default),
        }
    }

    /// How often target names are resolved again; more often than the floor only loads the
    /// resolver.
    fn dns_refresh(&self, field: &str, ms: Option<u64>) -> Result<Duration, RulesError> {
        match ms {
            Some(ms) if ms < MIN_DNS_REFRESH_MS => Err(self.err(
                format!("{field}.dns_refresh_ms"),
                format!("must be at least {MIN_DNS_REFRESH_MS}"),
            )),
            Some(ms) => Ok(Duration::from_millis(ms)),
            None => Ok(DEFAULT_DNS_REFRESH),
        }
    }

    /// `"balance": "hash"` keeps a caller to a target by its key id (a token's caller id), so
    /// it needs callers who have one: on an upstream that no route requiring a key or a token
    /// reaches, every caller would be hashed by its address, which behind a NAT or a partner's
    /// egress proxy puts a whole fleet of callers on one target.
    pub(super) fn hashed_by_key(&self, upstreams: &Upstreams, routes: &[Route]) -> Result<(), RulesError> {
        for (i, u) in upstreams.list.iter().enumerate() {
            let keyed = routes
                .iter()
                .any(|r| r.serves == Serves::Upstream(i) && r.key == KeyRequirement::Required);
            if u.balance == Balance::Hash && !keyed {
                return Err(self.err(
                    format!("upstreams.{}.balance", u.name),
                    "\"hash\" keeps each caller to one target by its key id, and no route that requires a key (or a JWT) reaches this upstream, so every caller would be hashed by its address; use \"least_request\" or \"round_robin\", or route keyed callers here",
                ));
            }
        }
        Ok(())
    }

    fn health(&self, field: &str, prefix: &str, h: &RawHealth) -> Result<Health, RulesError> {
        if !h.path.starts_with('/') || h.path.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(self.err(
                format!("{field}.health.path"),
                format!("{:?} is not a path starting with /", h.path),
            ));
        }
        let ms = |name: &str, v: Option<u64>, default: u64| match v {
            Some(0) => Err(self.err(format!("{field}.health.{name}"), "must be above zero")),
            Some(ms) => Ok(Duration::from_millis(ms)),
            None => Ok(Duration::from_millis(default)),
        };
        let times = |name: &str, v: Option<u32>| match v {
            Some(0) => Err(self.err(format!("{field}.health.{name}"), "must be at least 1")),
            Some(n) => Ok(n),
            None => Ok(2),
        };
        let interval = ms("interval_ms", h.interval_ms, 2000)?;
        let timeout = ms("timeout_ms", h.timeout_ms, 1000)?;
        if timeout > interval {
            return Err(self.err(
                format!("{field}.health.timeout_ms"),
                "must be at most interval_ms: a check ends before the next begins",
            ));
        }
        Ok(Health {
            path: format!("{prefix}{}", h.path),
            interval,
            timeout,
            unhealthy_after: times("unhealthy_after", h.unhealthy_after)?,
            healthy_after: times("healthy_after", h.healthy_after)?,
        })
    }

    /// A base URL: `http://` or `https://`, a host, no query.
    fn base_url(
        &self,
        field: &str,
        url: &str,
    ) -> Result<(http::Uri, http::uri::Scheme, Authority), RulesError> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| self.err(field, format!("{url:?} is not a URL: {e}")))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| self.err(field, format!("{url:?} needs a scheme, http:// or https://")))?;
        if scheme != http::uri::Scheme::HTTPS && scheme != http::uri::Scheme::HTTP {
            return Err(self.err(
                field,
                format!("{url:?}: only http:// and https:// upstreams are supported"),
            ));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| self.err(field, format!("{url:?} needs a host")))?;
        if uri.query().is_some() {
            return Err(self.err(field, "a base URL can't have a query"));
        }
        Ok((uri, scheme, authority))
    }

    fn eject(&self, field: &str, raw: Option<&RawEject>) -> Result<Eject, RulesError> {
        let consecutive_failures = match raw.and_then(|e| e.consecutive_failures) {
            Some(0) => {
                return Err(self.err(
                    format!("{field}.eject.consecutive_failures"),
                    "must be at least 1",
                ));
            }
            Some(n) => n,
            None => 5,
        };
        let first = match raw.and_then(|e| e.for_ms) {
            Some(0) => return Err(self.err(format!("{field}.eject.for_ms"), "must be above zero")),
            Some(ms) if Duration::from_millis(ms) > MAX_EJECTION => {
                return Err(self.err(
                    format!("{field}.eject.for_ms"),
                    format!("must be at most {} (10 minutes)", MAX_EJECTION.as_millis()),
                ));
            }
            Some(ms) => Duration::from_millis(ms),
            None => Duration::from_secs(30),
        };
        let max_percent = match raw.and_then(|e| e.max_percent) {
            Some(p) if p > 100 => {
                return Err(self.err(format!("{field}.eject.max_percent"), "must be 0 to 100"));
            }
            Some(p) => p,
            None => 50,
        };
        Ok(Eject {
            consecutive_failures,
            first,
            max_percent,
        })
    }

    fn retries(&self, field: &str, raw: Option<&RawRetries>) -> Result<Retries, RulesError> {
        let attempts = match raw.and_then(|r| r.attempts) {
            Some(n) if n > MAX_RETRIES => {
                return Err(self.err(
                    format!("{field}.retries.attempts"),
                    format!("must be at most {MAX_RETRIES}"),
                ));
            }
            Some(n) => n,
            None => 2,
        };
        let budget_percent = match raw.and_then(|r| r.budget_percent) {
            Some(p) if p > 100 => {
                return Err(self.err(format!("{field}.retries.budget_percent"), "must be 0 to 100"));
            }
            Some(p) => p,
            None => 20,
        };
        Ok(Retries {
            attempts,
            budget_percent,
        })
    }

    /// An `https://` upstream's TLS settings: its CA file read relative to the rules file, and
    /// the name its certificate must carry.
    pub(super) fn upstream_tls(
        &self,
        field: &str,
        authority: &Authority,
        raw: Option<&RawUpstreamTls>,
    ) -> Result<UpstreamTls, RulesError> {
        let raw_ca = raw.and_then(|t| t.ca.as_deref());
        let ca = match raw_ca {
            Some("") => return Err(self.err(format!("{field}.tls.ca"), "must not be empty")),
            Some(name) => Some((
                name,
                (self.read)(name).map_err(|e| self.err(format!("{field}.tls.ca"), e))?,
            )),
            None => None,
        };
        let (name_field, name) = match raw.and_then(|t| t.server_name.as_deref()) {
            Some(n) => (format!("{field}.tls.server_name"), n),
            None => (
                format!("{field}.url"),
                authority.host().trim_start_matches('[').trim_end_matches(']'),
            ),
        };
        let named = raw.is_some_and(|t| t.server_name.is_some());
        UpstreamTls::new(name, ca.as_ref().map(|(n, pem)| (*n, pem.as_slice()))).map_err(|e| match e {
            tls::TlsSettingError::ServerName(_) if !named => self.err(
                name_field,
                format!("{e}; set tls.server_name to the name its certificate carries"),
            ),
            tls::TlsSettingError::ServerName(_) => self.err(name_field, e.to_string()),
            tls::TlsSettingError::Ca { .. } => self.err(format!("{field}.tls.ca"), e.to_string()),
            tls::TlsSettingError::Setup(_) => self.err(format!("{field}.tls"), e.to_string()),
        })
    }

    /// An upstream's `concurrency` block: its bounds when adaptive, none when switched off.
    pub(super) fn concurrency(
        &self,
        field: &str,
        c: &RawConcurrency,
        max_in_flight: Option<u32>,
    ) -> Result<Option<ConcurrencyBounds>, RulesError> {
        let field = format!("{field}.concurrency");
        let min = c.min.unwrap_or(DEFAULT_CONCURRENCY_MIN);
        let max = c.max.unwrap_or(DEFAULT_CONCURRENCY_MAX);
        if min == 0 {
            return Err(self.err(format!("{field}.min"), "must be above zero"));
        }
        if max > MAX_CONCURRENCY {
            return Err(self.err(
                format!("{field}.max"),
                format!("{max} is above {MAX_CONCURRENCY}, the most an adaptive limit may reach"),
            ));
        }
        if max < min {
            return Err(self.err(format!("{field}.max"), format!("{max} is below min {min}")));
        }
        if let Some(cap) = max_in_flight
            && min > cap
        {
            return Err(self.err(
                format!("{field}.min"),
                format!("{min} is above max_in_flight {cap}, the ceiling every limit stays under"),
            ));
        }
        if !c.adaptive {
            return Ok(None);
        }
        ConcurrencyBounds::new(min, max)
            .map(Some)
            .map_err(|e| self.err(field, e))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{base, err, ok};
    use crate::Balance;
    use serde_json::json;

    #[test]
    fn targets_compile_with_their_weights_and_the_first_as_the_host() {
        let mut rules = base();
        rules["upstreams"]["u"] = json!({"targets": [
            {"url": "http://10.0.0.5:8080", "weight": 2}, {"url": "http://10.0.0.6:8080"}],
            "balance": "round_robin", "eject": {"consecutive_failures": 3}, "retries": {"attempts": 1}});
        let snap = ok(&rules);
        let u = &snap.upstreams[0];
        let t: Vec<(String, u32)> = u
            .targets
            .iter()
            .map(|t| (t.authority.to_string(), t.weight))
            .collect();
        assert_eq!(t, [("10.0.0.5:8080".into(), 2), ("10.0.0.6:8080".into(), 1)]);
        assert_eq!(u.authority.as_str(), "10.0.0.5:8080");
        assert_eq!(u.balance, Balance::RoundRobin);
        assert_eq!((u.eject.consecutive_failures, u.eject.max_percent), (3, 50));
        assert_eq!((u.retries.attempts, u.retries.budget_percent), (1, 20));
        // One `url` is one target of weight 1.
        let snap = ok(&base());
        assert_eq!(snap.upstreams[0].targets.len(), 1);
        assert_eq!(snap.upstreams[0].balance, Balance::LeastRequest);
    }

    #[test]
    fn bad_targets_are_refused_by_field() {
        for (upstream, field, says) in [
            (json!({"targets": []}), "upstreams.u.targets", "at least one"),
            (
                json!({"targets": [{"url": "http://a:1", "weight": 0}]}),
                "upstreams.u.targets[0].weight",
                "at least 1",
            ),
            (
                json!({"url": "http://a:1", "targets": [{"url": "http://a:1"}]}),
                "upstreams.u.targets",
                "not both",
            ),
            (json!({}), "upstreams.u.url", "missing"),
            (
                json!({"targets": [{"url": "http://a:1"}, {"url": "https://b:1"}]}),
                "upstreams.u.targets[1].url",
                "scheme and path prefix",
            ),
            (
                json!({"targets": [{"url": "http://a:1"}, {"url": "http://a:1"}]}),
                "upstreams.u.targets[1].url",
                "named twice",
            ),
            (
                json!({"url": "http://a:1", "eject": {"max_percent": 101}}),
                "upstreams.u.eject.max_percent",
                "0 to 100",
            ),
            (
                json!({"max_in_flight": 4, "targets": [{"url": "http://a:1", "max_in_flight": 2}]}),
                "upstreams.u.targets[0].max_in_flight",
                "not both",
            ),
            (
                json!({"targets": [{"url": "http://a:1", "max_in_flight": 0}]}),
                "upstreams.u.targets[0].max_in_flight",
                "above zero",
            ),
            (
                json!({"url": "http://a:1", "dns_refresh_ms": 10}),
                "upstreams.u.dns_refresh_ms",
                "at least 100",
            ),
            (
                json!({"url": "http://a:1", "retries": {"attempts": 11}}),
                "upstreams.u.retries.attempts",
                "at most 10",
            ),
            (
                json!({"url": "http://a:1", "health": {"path": "healthz"}}),
                "upstreams.u.health.path",
                "starting with /",
            ),
            (
                json!({"url": "http://a:1", "health": {"path": "/h", "interval_ms": 100, "timeout_ms": 200}}),
                "upstreams.u.health.timeout_ms",
                "at most interval_ms",
            ),
            (
                json!({"url": "http://a:1", "health": {"path": "/h", "healthy_after": 0}}),
                "upstreams.u.health.healthy_after",
                "at least 1",
            ),
        ] {
            let mut rules = base();
            rules["upstreams"]["u"] = upstream.clone();
            let e = err(&rules);
            assert_eq!(e.field, field, "{upstream}: {e}");
            assert!(e.reason.contains(says), "{upstream}: {e}");
        }
        let mut rules = base();
        rules["upstreams"]["u"] = json!({"url": "http://a:1", "balance": "random"});
        let e = err(&rules);
        assert!(e.to_string().contains("random"), "{e}");
    }

    /// A hash needs callers with keys: an upstream that only anonymous-capable routes reach,
    /// or none, is refused; one keyed route is enough, its anonymous neighbours hashed by
    /// address.
    #[test]
    fn a_hash_needs_a_route_that_requires_a_key() {
        let hashed = json!({"targets": [{"url": "http://a:1"}, {"url": "http://b:1"}], "balance": "hash"});
        let mut rules = base();
        rules["upstreams"]["u"] = hashed.clone();
        assert_eq!(ok(&rules).upstreams[0].balance, Balance::Hash);
        rules["routes"][0]["key"] = "optional".into();
        let e = err(&rules);
        assert_eq!(e.field, "upstreams.u.balance", "{e}");
        assert!(e.reason.contains("hashed by its address"), "{e}");
        let mut keyed = rules["routes"][0].clone();
        keyed["key"] = "required".into();
        keyed["path"] = "/v2".into();
        rules["routes"].as_array_mut().unwrap().push(keyed);
        ok(&rules);
        // An upstream no route reaches has no caller to hash.
        let mut rules = base();
        rules["upstreams"]["spare"] = hashed;
        assert_eq!(err(&rules).field, "upstreams.spare.balance");
    }

    #[test]
    fn an_upstream_url_without_a_host_is_refused_by_field() {
        let mut rules = base();
        rules["upstreams"]["u"]["url"] = "http://".into();
        let e = err(&rules);
        assert_eq!(e.field, "upstreams.u.url", "{e}");
    }

    #[test]
    fn an_upstream_of_another_scheme_is_refused() {
        let mut rules = base();
        rules["upstreams"]["u"]["url"] = "ftp://127.0.0.1:21".into();
        let e = err(&rules);
        assert_eq!(e.field, "upstreams.u.url", "{e}");
        assert!(e.reason.contains("ftp"), "{e}");
    }

    /// Plain by default; `https://` takes TLS settings, checked against the built-in roots
    /// for the URL's host.
    #[test]
    fn an_https_upstream_speaks_tls_and_a_plain_one_does_not() {
        let snap = ok(&base());
        assert!(snap.upstreams[0].tls.is_none());
        let mut rules = base();
        rules["upstreams"]["u"]["url"] = "https://example.com".into();
        let snap = ok(&rules);
        assert_eq!(snap.upstreams[0].authority.as_str(), "example.com");
        assert!(snap.upstreams[0].tls.is_some());
    }
}
