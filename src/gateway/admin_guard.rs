//! Who may use the admin listener: the `Host` a request names, so a web page can't reach the
//! listener through DNS rebinding.

use std::net::IpAddr;

/// The host names the admin listener answers besides IP literals and `localhost`.
#[derive(Debug, Clone, Default)]
pub struct AdminHosts(Vec<String>);

impl AdminHosts {
    pub fn new(names: &[String]) -> AdminHosts {
        AdminHosts(names.iter().map(|n| n.trim().to_ascii_lowercase()).collect())
    }

    /// Whether a request naming `host` (a `Host` header or an absolute URI's authority, port
    /// and all) may be served. A browser sends the name it resolved, so a rebound name is
    /// refused here even when it now points at this listener.
    pub fn allows(&self, host: &str) -> bool {
        let name = strip_port(host).to_ascii_lowercase();
        if name.is_empty() {
            return false;
        }
        if name == "localhost" || name.parse::<IpAddr>().is_ok() {
            return true;
        }
        if let Some(v6) = name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
            return v6.parse::<std::net::Ipv6Addr>().is_ok();
        }
        self.0.contains(&name)
    }
}

/// `host[:port]` or `[v6][:port]` without the port.
fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) && !name.contains(':') => name,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_literals_and_localhost_pass_and_other_names_need_naming() {
        let none = AdminHosts::default();
        for ok in [
            "127.0.0.1:9000",
            "127.0.0.1",
            "[::1]:9000",
            "[::1]",
            "localhost:1",
            "LOCALHOST",
        ] {
            assert!(none.allows(ok), "{ok}");
        }
        for bad in [
            "evil.example:9000",
            "evil.example",
            "",
            ":9000",
            "127.0.0.1.evil.example",
            "[::1",
        ] {
            assert!(!none.allows(bad), "{bad}");
        }
        let named = AdminHosts::new(&["Gateway-1.internal".to_string()]);
        assert!(named.allows("gateway-1.internal:9901"));
        assert!(!named.allows("gateway-2.internal:9901"));
    }
}
