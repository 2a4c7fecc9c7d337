//! How a connection reaches a Redis store beyond its address: TLS (the built-in roots or a
//! private CA, a client certificate, the name the server's certificate carries) and
//! credentials (a user, and a password read from a file and read again on a reload, so a
//! rotated password needs no restart). Every connection to the store takes them: the checks',
//! the side clients', each primary's of a cluster, and the meter's, which is why this is a
//! crate below both the store and the meter.

use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};

use arc_swap::ArcSwap;
use fred::prelude::{Config, Error as FredError, ErrorKind, Server, ServerConfig};
use fred::types::config::{CredentialProvider, TlsConfig, TlsHostMapping};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};

/// The public web's roots (Mozilla's list, built in), for a store whose certificate a public
/// CA signed (ElastiCache, Azure Cache, Memorystore, Upstash): the same wherever the gateway
/// runs, whatever the host's certificate store holds.
static WEB_ROOTS: LazyLock<Arc<RootCertStore>> = LazyLock::new(|| {
    Arc::new(RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    })
});

/// What a TLS connection to the store checks and shows.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// PEM CA certificates the store's certificate must chain to; the built-in roots without.
    pub ca: Option<PathBuf>,
    /// A PEM client certificate chain and its key, for a store that asks for one.
    pub client: Option<(PathBuf, PathBuf)>,
    /// The name the store's certificate must carry, where its address is not that name.
    pub server_name: Option<String>,
}

/// TLS to the store, built once from [`TlsFiles`]: one rustls config for every connection.
#[derive(Clone)]
pub struct StoreTls {
    config: Arc<ClientConfig>,
    server_name: Option<String>,
    /// `ca=… client-cert=… server-name=…`, or the built-in roots: what start-up says.
    pub described: String,
}

impl std::fmt::Debug for StoreTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.described)
    }
}

impl StoreTls {
    /// Reads and checks the files: a CA that is missing, not PEM or not a usable root, a client
    /// certificate or key that doesn't load, or a server name that is no DNS name or address
    /// is an error naming the flag and the file.
    pub fn new(files: &TlsFiles) -> Result<StoreTls, String> {
        let roots = match &files.ca {
            None => WEB_ROOTS.clone(),
            Some(path) => {
                Arc::new(read_roots(path).map_err(|why| format!("--store-ca {}: {why}", path.display()))?)
            }
        };
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("TLS to the store: {e}"))?
                .with_root_certificates(roots);
        let config = match &files.client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain =
                    read_certs(cert).map_err(|why| format!("--store-cert {}: {why}", cert.display()))?;
                let key_der = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("--store-key {}: not a PEM private key: {e}", key.display()))?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                    format!("--store-cert/--store-key: the key does not suit the certificate: {e}")
                })?
            }
        };
        if let Some(name) = &files.server_name {
            ServerName::try_from(name.clone())
                .map_err(|_| format!("--store-server-name {name:?}: not a DNS name or an IP address"))?;
        }
        let mut described = match &files.ca {
            Some(ca) => format!("ca={}", ca.display()),
            None => "built-in roots".to_string(),
        };
        if let Some((cert, _)) = &files.client {
            described.push_str(&format!(" client-cert={}", cert.display()));
        }
        if let Some(name) = &files.server_name {
            described.push_str(&format!(" server-name={name}"));
        }
        Ok(StoreTls {
            config: Arc::new(config),
            server_name: files.server_name.clone(),
            described,
        })
    }

    /// fred's TLS settings; a cluster's nodes are reached by the addresses the cluster gives,
    /// each checked against the server name when one is set.
    pub fn fred(&self) -> TlsConfig {
        let mut tls = TlsConfig::from((*self.config).clone());
        if let Some(name) = &self.server_name {
            tls.hostnames = TlsHostMapping::Custom(Arc::new(FixedName(name.clone())));
        }
        tls
    }

    /// `server` as a TLS connection reaches it: under the server name when one is set.
    pub fn server(&self, server: &Server) -> Server {
        Server::new_with_tls(server.host.clone(), server.port, self.server_name.clone())
    }
}

/// Every node's certificate checked against one name.
#[derive(Debug)]
struct FixedName(String);

impl fred::types::config::HostMapping for FixedName {
    fn map(&self, _ip: &std::net::IpAddr, _default_host: &str) -> Option<String> {
        Some(self.0.clone())
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = std::fs::read(path).map_err(|e| e.to_string())?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not a valid PEM file: {e}"))?;
    if certs.is_empty() {
        return Err("no CERTIFICATE block: expected PEM certificates".into());
    }
    Ok(certs)
}

fn read_roots(path: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for (i, cert) in read_certs(path)?.into_iter().enumerate() {
        roots
            .add(cert)
            .map_err(|e| format!("certificate {} is not a usable CA certificate: {e}", i + 1))?;
    }
    Ok(roots)
}

/// The user and password every new connection authenticates with: the password read from
/// `--store-password-file`, again on each [`reload`](Credentials::reload). Connections already
/// open stay as they authenticated; the next one takes the new password.
#[derive(Debug)]
pub struct Credentials {
    username: Option<String>,
    file: Option<PathBuf>,
    password: ArcSwap<Option<String>>,
}

impl Credentials {
    /// Reads the password file now: missing or empty is an error naming the file.
    pub fn new(username: Option<String>, file: Option<PathBuf>) -> Result<Arc<Credentials>, String> {
        let password = match &file {
            Some(f) => Some(read_password(f)?),
            None => None,
        };
        Ok(Arc::new(Credentials {
            username,
            file,
            password: ArcSwap::from_pointee(password),
        }))
    }

    /// Reads the password file again. A file that no longer reads keeps the password in use,
    /// and the error says why. `Ok(true)`: the password changed.
    pub fn reload(&self) -> Result<bool, String> {
        let Some(f) = &self.file else {
            return Ok(false);
        };
        let new = read_password(f)?;
        let changed = self.password.load().as_deref() != Some(new.as_str());
        self.password.store(Arc::new(Some(new)));
        Ok(changed)
    }

    pub fn username(&self) -> Option<&str> {
        self.username.as_deref()
    }

    /// Whether the password comes from a file.
    pub fn has_file(&self) -> bool {
        self.file.is_some()
    }
}

#[async_trait::async_trait]
impl CredentialProvider for Credentials {
    async fn fetch(&self, _server: Option<&Server>) -> Result<(Option<String>, Option<String>), FredError> {
        Ok((self.username.clone(), (**self.password.load()).clone()))
    }
}

/// The file's first line, without its line end: a secret manager's mounted file often ends
/// with a newline the password doesn't have.
fn read_password(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--store-password-file {}: {e}", path.display()))?;
    let line = text.lines().next().unwrap_or("").to_string();
    if line.is_empty() {
        return Err(format!(
            "--store-password-file {}: the file is empty",
            path.display()
        ));
    }
    Ok(line)
}

/// TLS and credentials for every connection to one store. The default is plain TCP with
/// whatever credentials the URL carries.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Used when the URL asks for TLS (`rediss://`, `rediss-cluster://`); the built-in roots
    /// when unset.
    pub tls: Option<StoreTls>,
    pub credentials: Option<Arc<Credentials>>,
}

static NO_ACCESS: LazyLock<Access> = LazyLock::new(Access::default);

impl Access {
    /// Plain TCP, the URL's credentials.
    pub fn none() -> &'static Access {
        &NO_ACCESS
    }

    /// The TLS settings for a store whose URL asks for TLS.
    pub fn tls_or_roots(&self) -> Result<StoreTls, FredError> {
        match &self.tls {
            Some(t) => Ok(t.clone()),
            None => StoreTls::new(&TlsFiles::default()).map_err(|e| FredError::new(ErrorKind::Tls, e)),
        }
    }

    /// The access the `--store-*` flags describe: TLS settings when any file or name is given,
    /// credentials when a user or a password file is. Files that don't read are errors naming
    /// the flag and the file.
    pub fn from_flags(
        files: TlsFiles,
        username: Option<String>,
        password_file: Option<PathBuf>,
    ) -> Result<Access, String> {
        let tls_asked = files.ca.is_some() || files.client.is_some() || files.server_name.is_some();
        let creds_asked = username.is_some() || password_file.is_some();
        Ok(Access {
            tls: if tls_asked {
                Some(StoreTls::new(&files)?)
            } else {
                None
            },
            credentials: if creds_asked {
                Some(Credentials::new(username, password_file)?)
            } else {
                None
            },
        })
    }

    /// Puts this access's TLS (when `tls`: the URL asks for it) and credentials into fred's
    /// `config`. TLS settings for a plain URL, and a URL's password beside a password file,
    /// are refused: each would be a flag that does nothing, or one too many.
    pub fn apply(&self, config: &mut Config, tls: bool) -> Result<(), String> {
        if tls {
            let tls = self.tls_or_roots().map_err(|e| e.details().to_string())?;
            config.tls = Some(tls.fred());
            if let ServerConfig::Centralized { server } = &mut config.server {
                *server = tls.server(server);
            }
        } else if self.tls.is_some() {
            return Err("TLS settings (--store-ca, --store-cert, --store-server-name) need a TLS URL: rediss://, valkeys:// or rediss-cluster://".into());
        }
        if let Some(creds) = &self.credentials {
            if config.password.is_some() && creds.has_file() {
                return Err("a password in the URL and --store-password-file: give it one way (the file keeps it out of `ps`)".into());
            }
            if creds.has_file() {
                config.credential_provider = Some(creds.clone());
            } else if let Some(user) = creds.username() {
                config.username = Some(user.to_string());
            }
        }
        Ok(())
    }

    /// What start-up says of the user: the one named, or `default`.
    pub fn user(&self, url_user: Option<&str>) -> String {
        self.credentials
            .as_ref()
            .and_then(|c| c.username())
            .or(url_user)
            .unwrap_or("default")
            .to_string()
    }
}

/// `url` with its password replaced, for logs, errors and the admin pages.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (auth, host) = match rest.rsplit_once('@') {
        Some(parts) => parts,
        None => return url.to_string(),
    };
    match auth.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None if !auth.is_empty() => format!("{scheme}://***@{host}"),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn a_password_never_shows() {
        assert_eq!(redact("redis://u:secret@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("rediss://:secret@h:1"), "rediss://:***@h:1");
        assert_eq!(redact("redis://secret@h:1"), "redis://***@h:1");
        assert_eq!(redact("redis://h:1"), "redis://h:1");
        assert_eq!(redact("redis://u:p@ss@h:1"), "redis://u:***@h:1");
    }
}
