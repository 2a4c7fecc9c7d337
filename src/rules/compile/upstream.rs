//! The `upstreams` of a rules file: where each is, how it is reached (TLS), and its
//! limits on requests in flight.

use super::*;

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
        let uri: http::Uri = u
            .url
            .parse()
            .map_err(|e| self.err(format!("{field}.url"), format!("{:?} is not a URL: {e}", u.url)))?;
        let scheme = uri.scheme().cloned().ok_or_else(|| {
            self.err(
                format!("{field}.url"),
                format!("{:?} needs a scheme, http:// or https://", u.url),
            )
        })?;
        let https = scheme == http::uri::Scheme::HTTPS;
        if !https && scheme != http::uri::Scheme::HTTP {
            return Err(self.err(
                format!("{field}.url"),
                format!("{:?}: only http:// and https:// upstreams are supported", u.url),
            ));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| self.err(format!("{field}.url"), format!("{:?} needs a host", u.url)))?;
        let tls = match (https, &u.tls) {
            (true, t) => Some(self.upstream_tls(&field, &authority, t.as_ref())?),
            (false, None) => None,
            (false, Some(_)) => {
                return Err(self.err(
                    format!("{field}.tls"),
                    format!(
                        "{:?} is http://: only an https:// upstream takes TLS settings",
                        u.url
                    ),
                ));
            }
        };
        if uri.query().is_some() {
            return Err(self.err(format!("{field}.url"), "a base URL can't have a query"));
        }
        let path_prefix = uri.path().trim_end_matches('/').to_string();
        let timeout = match u.timeout_ms {
            Some(0) => return Err(self.err(format!("{field}.timeout_ms"), "must be above zero")),
            Some(ms) => Duration::from_millis(ms),
            None => DEFAULT_UPSTREAM_TIMEOUT,
        };
        if u.max_in_flight == Some(0) {
            return Err(self.err(format!("{field}.max_in_flight"), "must be above zero"));
        }
        let queue_timeout = u
            .queue_timeout_ms
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_QUEUE_TIMEOUT);
        let host_header = HeaderValue::from_str(authority.as_str())
            .map_err(|_| self.err(format!("{field}.url"), "the host can't be a Host header"))?;
        let idle_timeout = match u.idle_timeout_ms {
            Some(0) => return Err(self.err(format!("{field}.idle_timeout_ms"), "must be above zero")),
            Some(ms) => Duration::from_millis(ms),
            None => DEFAULT_IDLE_TIMEOUT,
        };
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
