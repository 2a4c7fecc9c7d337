//! Who may use the admin listener: the `Host` a request names (so a web page can't reach the
//! listener through DNS rebinding) and the bearer token that key changes need.

use std::net::IpAddr;
use std::path::Path;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The operator's admin token, kept as its SHA-256 so a comparison takes the same time whatever
/// the presented value's length and wherever it first differs.
#[derive(Clone)]
pub struct AdminToken([u8; 32]);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

impl AdminToken {
    /// Reads the token from `path`: its first line, without the line end. An unreadable,
    /// empty or short file is refused by name: a gateway must not start with a guessable token.
    pub fn read(path: &Path) -> Result<AdminToken, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--admin-token-file {}: cannot read: {e}", path.display()))?;
        let token = text.lines().next().unwrap_or("").trim();
        if token.len() < 16 {
            return Err(format!(
                "--admin-token-file {}: the token must be at least 16 characters on the file's first line (it has {})",
                path.display(),
                token.len()
            ));
        }
        Ok(AdminToken::new(token))
    }

    pub fn new(token: &str) -> AdminToken {
        AdminToken(Sha256::digest(token.as_bytes()).into())
    }

    /// Whether an `Authorization` header carries this token as `Bearer`.
    pub fn allows(&self, authorization: Option<&http::HeaderValue>) -> bool {
        let Some(given) = authorization
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
        else {
            return false;
        };
        let given: [u8; 32] = Sha256::digest(given.trim().as_bytes()).into();
        given.ct_eq(&self.0).into()
    }
}

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

    #[test]
    fn only_the_exact_bearer_token_passes() {
        let t = AdminToken::new("a-long-enough-admin-token");
        let h = |s: &str| http::HeaderValue::from_str(s).unwrap();
        assert!(t.allows(Some(&h("Bearer a-long-enough-admin-token"))));
        for bad in [
            "Bearer a-long-enough-admin-toke",
            "Bearer a-long-enough-admin-token-",
            "bearer a-long-enough-admin-token",
            "Basic a-long-enough-admin-token",
            "a-long-enough-admin-token",
            "Bearer ",
        ] {
            assert!(!t.allows(Some(&h(bad))), "{bad}");
        }
        assert!(!t.allows(None));
    }

    #[test]
    fn a_token_file_must_hold_a_long_enough_token() {
        let dir = std::env::temp_dir().join(format!("tollgate-admin-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let short = dir.join("short");
        std::fs::write(&short, "secret\n").unwrap();
        let e = AdminToken::read(&short).unwrap_err();
        assert!(e.contains("short") && e.contains("at least 16"), "{e}");
        let good = dir.join("good");
        std::fs::write(&good, "0123456789abcdef0123\nignored\n").unwrap();
        let t = AdminToken::read(&good).unwrap();
        assert!(t.allows(Some(&http::HeaderValue::from_static(
            "Bearer 0123456789abcdef0123"
        ))));
        let e = AdminToken::read(&dir.join("missing")).unwrap_err();
        assert!(e.contains("missing") && e.contains("cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
