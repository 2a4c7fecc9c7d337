//! Real Redis over TLS and with ACL users, for the tests of `rediss://` stores: a test PKI made
//! with rcgen (a CA, good, expired and misnamed server certificates, a client certificate and an
//! unrelated CA), a `redis-server` that listens with TLS only, and ACL helpers that work on it
//! and on a plain [`RedisServer`] alike. Everything is stopped or removed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose,
};

use super::redis::RedisServer;
use super::{free_port, require_binary};

/// Which certificate a [`RedisTlsServer`] shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ServerCert {
    /// Signed by the test CA, for `localhost` and `127.0.0.1`, valid until 4096.
    #[default]
    Good,
    /// Signed by the test CA, for `localhost` and `127.0.0.1`, valid only during the year 2000.
    Expired,
    /// Signed by the test CA, valid, for `other.test` only (no IP address).
    OtherName,
}

/// `tls-auth-clients`: whether the server asks for a client certificate signed by the test CA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ClientAuth {
    /// A client without a certificate signed by the test CA is refused.
    Yes,
    /// The server asks for no certificate.
    #[default]
    No,
    /// A certificate is asked for; a client without one is let in, one with a bad one is not.
    Optional,
}

impl ClientAuth {
    pub fn as_str(self) -> &'static str {
        match self {
            ClientAuth::Yes => "yes",
            ClientAuth::No => "no",
            ClientAuth::Optional => "optional",
        }
    }
}

/// A throw-away PKI as PEM files in a temporary directory, made at once by [`TestPki::new`]:
///
/// - the test CA (`ca_pem`, `ca_key_pem`);
/// - its server certificates, one per [`ServerCert`] (`server_cert_pem`, `server_key_pem`);
/// - its client certificate for `tls-auth-clients` (`client_cert_pem`, `client_key_pem`);
/// - an unrelated CA, the wrong one to trust (`other_ca_pem`, `other_ca_key_pem`), and a client
///   certificate it signed (`stranger_cert_pem`, `stranger_key_pem`).
///
/// Keys are ECDSA P-256 in PKCS#8. Cloning shares the directory, removed with the last clone.
#[derive(Clone)]
pub struct TestPki {
    dir: Arc<tempfile::TempDir>,
}

impl Default for TestPki {
    fn default() -> Self {
        TestPki::new()
    }
}

impl TestPki {
    pub fn new() -> TestPki {
        let pki = TestPki {
            dir: Arc::new(tempfile::tempdir().expect("tempdir for the test PKI")),
        };
        let ca = pki.ca("ca", "Tollgate test CA");
        let localhost = ["localhost", "127.0.0.1"];
        pki.leaf(
            &ca,
            "server",
            &localhost,
            ExtendedKeyUsagePurpose::ServerAuth,
            false,
        );
        pki.leaf(
            &ca,
            "expired",
            &localhost,
            ExtendedKeyUsagePurpose::ServerAuth,
            true,
        );
        pki.leaf(
            &ca,
            "other-name",
            &["other.test"],
            ExtendedKeyUsagePurpose::ServerAuth,
            false,
        );
        pki.leaf(
            &ca,
            "client",
            &["tollgate-client"],
            ExtendedKeyUsagePurpose::ClientAuth,
            false,
        );
        let other = pki.ca("other-ca", "Tollgate other CA");
        pki.leaf(
            &other,
            "stranger",
            &["stranger"],
            ExtendedKeyUsagePurpose::ClientAuth,
            false,
        );
        pki
    }

    /// A self-signed CA written as `{stem}.pem` and `{stem}-key.pem`.
    fn ca(&self, stem: &str, common_name: &str) -> Issuer<'static, KeyPair> {
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("a CA key");
        let cert = params.self_signed(&key).expect("a self-signed CA");
        self.write(stem, &cert.pem(), &key.serialize_pem());
        Issuer::new(params, key)
    }

    /// A certificate for `names` (DNS names or IP addresses) signed by `ca`, written as
    /// `{stem}.pem` and `{stem}-key.pem`; valid only in 2000 if `expired`.
    fn leaf(
        &self,
        ca: &Issuer<'static, KeyPair>,
        stem: &str,
        names: &[&str],
        usage: ExtendedKeyUsagePurpose,
        expired: bool,
    ) {
        let sans: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(sans).expect("valid subject names");
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, names[0]);
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![usage];
        if expired {
            params.not_before = rcgen::date_time_ymd(2000, 1, 1);
            params.not_after = rcgen::date_time_ymd(2001, 1, 1);
        }
        let key = KeyPair::generate().expect("a leaf key");
        let cert = params
            .signed_by(&key, ca)
            .expect("a certificate signed by the CA");
        self.write(stem, &cert.pem(), &key.serialize_pem());
    }

    fn write(&self, stem: &str, cert: &str, key: &str) {
        std::fs::write(self.file(&format!("{stem}.pem")), cert).expect("write a certificate");
        std::fs::write(self.file(&format!("{stem}-key.pem")), key).expect("write a key");
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The directory of every file below.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The test CA's certificate: what a client trusts, and what the server checks clients with.
    pub fn ca_pem(&self) -> PathBuf {
        self.file("ca.pem")
    }

    pub fn ca_key_pem(&self) -> PathBuf {
        self.file("ca-key.pem")
    }

    pub fn server_cert_pem(&self, which: ServerCert) -> PathBuf {
        self.file(&format!("{}.pem", server_stem(which)))
    }

    pub fn server_key_pem(&self, which: ServerCert) -> PathBuf {
        self.file(&format!("{}-key.pem", server_stem(which)))
    }

    /// A client certificate (CN `tollgate-client`) signed by the test CA.
    pub fn client_cert_pem(&self) -> PathBuf {
        self.file("client.pem")
    }

    pub fn client_key_pem(&self) -> PathBuf {
        self.file("client-key.pem")
    }

    /// An unrelated CA: trusting it instead of the test CA must fail every handshake.
    pub fn other_ca_pem(&self) -> PathBuf {
        self.file("other-ca.pem")
    }

    pub fn other_ca_key_pem(&self) -> PathBuf {
        self.file("other-ca-key.pem")
    }

    /// A client certificate signed by the other CA, which the server must refuse.
    pub fn stranger_cert_pem(&self) -> PathBuf {
        self.file("stranger.pem")
    }

    pub fn stranger_key_pem(&self) -> PathBuf {
        self.file("stranger-key.pem")
    }

    /// A client that trusts the test CA and shows the test client certificate.
    pub fn client(&self) -> TlsClient {
        TlsClient::trusting(self.ca_pem()).with_cert(self.client_cert_pem(), self.client_key_pem())
    }

    /// A client that trusts the test CA and shows no certificate.
    pub fn client_without_cert(&self) -> TlsClient {
        TlsClient::trusting(self.ca_pem())
    }
}

fn server_stem(which: ServerCert) -> &'static str {
    match which {
        ServerCert::Good => "server",
        ServerCert::Expired => "expired",
        ServerCert::OtherName => "other-name",
    }
}

/// What `redis-cli --tls` trusts and shows: `--cacert`, and `--cert`/`--key` if any.
#[derive(Clone, Debug)]
pub struct TlsClient {
    pub ca: PathBuf,
    pub cert: Option<(PathBuf, PathBuf)>,
}

impl TlsClient {
    pub fn trusting(ca: PathBuf) -> TlsClient {
        TlsClient { ca, cert: None }
    }

    pub fn with_cert(mut self, cert: PathBuf, key: PathBuf) -> TlsClient {
        self.cert = Some((cert, key));
        self
    }
}

/// One `redis-cli` run: whether it exited 0, and what it printed (trimmed). A refused handshake
/// fails the run; an error reply (`WRONGPASS ...`, `NOAUTH ...`) does not: it is on stdout.
#[derive(Debug)]
pub struct CliOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// A real `redis-server` listening with TLS only (`port 0`, `tls-port` a free loopback port),
/// with no persistence; killed on drop. It keeps a clone of its [`TestPki`].
pub struct RedisTlsServer {
    pub port: u16,
    pub cert: ServerCert,
    pub client_auth: ClientAuth,
    pki: TestPki,
    child: Child,
    _dir: tempfile::TempDir,
}

impl RedisTlsServer {
    /// The good certificate, no client certificates asked for.
    pub fn start(pki: &TestPki) -> RedisTlsServer {
        RedisTlsServer::start_with(pki, ServerCert::Good, ClientAuth::No, &[])
    }

    /// Shows `cert`, asks for client certificates as `client_auth` says, and passes `extra` to
    /// redis-server after the rest. Fails the test if it does not listen within 5 s on any of
    /// five free ports, with the end of its log.
    pub fn start_with(
        pki: &TestPki,
        cert: ServerCert,
        client_auth: ClientAuth,
        extra: &[&str],
    ) -> RedisTlsServer {
        let mut dir = tempfile::tempdir().unwrap();
        let mut log = String::new();
        for _ in 0..5 {
            match RedisTlsServer::try_start(pki, cert, client_auth, extra, free_port(), dir) {
                Ok(server) => return server,
                Err((d, l)) => (dir, log) = (d, l),
            }
        }
        panic!(
            "redis-server did not start with TLS ({cert:?}, tls-auth-clients {client_auth:?}); its log:\n{log}"
        );
    }

    /// The server on `port`, once it accepts TCP there; else its directory and log.
    fn try_start(
        pki: &TestPki,
        cert: ServerCert,
        client_auth: ClientAuth,
        extra: &[&str],
        port: u16,
        dir: tempfile::TempDir,
    ) -> Result<RedisTlsServer, (tempfile::TempDir, String)> {
        let logfile = dir.path().join("redis.log");
        let mut child = Command::new(require_binary("redis-server"))
            // `--port 0`: no plain listener at all.
            .args(tollgate_testkit::redis_server_args(0, dir.path()))
            .arg("--tls-port")
            .arg(port.to_string())
            .arg("--tls-cert-file")
            .arg(pki.server_cert_pem(cert))
            .arg("--tls-key-file")
            .arg(pki.server_key_pem(cert))
            .arg("--tls-ca-cert-file")
            .arg(pki.ca_pem())
            .args(["--tls-auth-clients", client_auth.as_str()])
            .arg("--logfile")
            .arg(&logfile)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(RedisTlsServer {
                    port,
                    cert,
                    client_auth,
                    pki: pki.clone(),
                    child,
                    _dir: dir,
                });
            }
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        let log = std::fs::read_to_string(&logfile).unwrap_or_default();
        Err((dir, log))
    }

    /// `rediss://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }

    /// `rediss://USER:PASSWORD@127.0.0.1:PORT` (neither percent-encoded: keep them plain).
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!("rediss://{user}:{password}@127.0.0.1:{}", self.port)
    }

    pub fn pki(&self) -> &TestPki {
        &self.pki
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the server with SIGKILL, as a crash would, and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Runs `redis-cli` over TLS as [`TestPki::client`] (the right CA and the client
    /// certificate, so it gets in whatever `tls-auth-clients` says) and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        self.cli_as(&self.pki.client(), args).stdout
    }

    /// Runs `redis-cli --tls` with `client`'s CA and certificate; a refused handshake is a run
    /// that fails, with the reason on stderr.
    pub fn cli_as(&self, client: &TlsClient, args: &[&str]) -> CliOutput {
        let mut cmd = Command::new(require_binary("redis-cli"));
        cmd.arg("--tls").arg("--cacert").arg(&client.ca);
        if let Some((cert, key)) = &client.cert {
            cmd.arg("--cert").arg(cert).arg("--key").arg(key);
        }
        let out = cmd
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli runs");
        CliOutput {
            success: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).trim().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        }
    }
}

impl Drop for RedisTlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every key, channel and command: the rules of a user that may do anything.
pub const ALL_RULES: &[&str] = &["~*", "&*", "+@all"];

/// Something that runs one `redis-cli` command and returns its output: a [`RedisServer`], a
/// [`RedisTlsServer`], [`AsUser`], or a closure `|args: &[&str]| ... -> String`. The ACL helpers
/// are its provided methods; they fail the test when Redis refuses.
pub trait RedisCli {
    fn run(&self, args: &[&str]) -> String;

    /// `ACL SETUSER name reset on >password rules...`: a user made afresh (any earlier one of
    /// that name is replaced), enabled, with that one password and `rules` (see [`ALL_RULES`]).
    fn add_user(&self, name: &str, password: &str, rules: &[&str]) {
        let pass = format!(">{password}");
        let mut args = vec!["ACL", "SETUSER", name, "reset", "on", &pass];
        args.extend_from_slice(rules);
        acl_ok(&args, &self.run(&args));
    }

    /// `ACL SETUSER name resetpass >password`: the user's only password is now `password`.
    /// Connections already authenticated as the user stay so; see [`RedisCli::kill_user_clients`].
    fn set_password(&self, name: &str, password: &str) {
        let pass = format!(">{password}");
        let args = ["ACL", "SETUSER", name, "resetpass", &pass];
        acl_ok(&args, &self.run(&args));
    }

    /// `CLIENT KILL USER name`: closes every connection authenticated as the user (the one that
    /// runs this too, if it is that user's); how many.
    fn kill_user_clients(&self, name: &str) -> u64 {
        let out = self.run(&["CLIENT", "KILL", "USER", name]);
        out.parse()
            .unwrap_or_else(|_| panic!("CLIENT KILL USER {name} answered {out:?}"))
    }

    /// `ACL DELUSER name`, which also closes the user's connections.
    fn remove_user(&self, name: &str) {
        let out = self.run(&["ACL", "DELUSER", name]);
        assert_eq!(out, "1", "ACL DELUSER {name}");
    }

    /// `ACL SETUSER default off`: a connection must now AUTH as a user before any command. Add
    /// a user first and run the next commands through [`RedisCli::as_user`].
    fn disable_default_user(&self) {
        let args = ["ACL", "SETUSER", "default", "off"];
        acl_ok(&args, &self.run(&args));
    }

    /// The same `redis-cli`, authenticated as `user` (`--user`, `--pass`).
    fn as_user(&self, user: &str, password: &str) -> AsUser<'_, Self>
    where
        Self: Sized,
    {
        AsUser {
            cli: self,
            user: user.to_string(),
            password: password.to_string(),
        }
    }
}

fn acl_ok(args: &[&str], out: &str) {
    assert_eq!(out, "OK", "{} answered {out:?}", args.join(" "));
}

impl RedisCli for RedisServer {
    fn run(&self, args: &[&str]) -> String {
        self.cli(args)
    }
}

impl RedisCli for RedisTlsServer {
    fn run(&self, args: &[&str]) -> String {
        self.cli(args)
    }
}

impl<F: Fn(&[&str]) -> String> RedisCli for F {
    fn run(&self, args: &[&str]) -> String {
        self(args)
    }
}

/// A [`RedisCli`] that runs each command authenticated as one user.
pub struct AsUser<'a, C> {
    cli: &'a C,
    user: String,
    password: String,
}

impl<C: RedisCli> RedisCli for AsUser<'_, C> {
    fn run(&self, args: &[&str]) -> String {
        let mut all = vec![
            "--user",
            &self.user,
            "--pass",
            &self.password,
            "--no-auth-warning",
        ];
        all.extend_from_slice(args);
        self.cli.run(&all)
    }
}
