//! The fixtures of `common::redis_tls` against a real `redis-server` and `redis-cli`: the test
//! PKI's certificates are taken or refused as their names say, the server listens with TLS only
//! and asks for client certificates as told, and the ACL helpers make, change and cut off users
//! on a TLS server and on a plain one.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::sync::Arc;

use common::RedisServer;
use common::redis_tls::{ALL_RULES, ClientAuth, RedisCli, RedisTlsServer, ServerCert, TestPki, TlsClient};
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

/// `redis-cli` as `client` runs PING and is answered PONG.
fn pings(server: &RedisTlsServer, client: &TlsClient) -> bool {
    let out = server.cli_as(client, &["PING"]);
    out.success && out.stdout == "PONG"
}

/// `redis-cli` as `client` is refused at the handshake: a failed run with no PONG, whose stderr
/// says `reason` (the client's own verdict; a server that refuses just closes the connection).
fn assert_refused(server: &RedisTlsServer, client: &TlsClient, why: &str, reason: &str) {
    let out = server.cli_as(client, &["PING"]);
    assert!(
        !out.success && out.stdout != "PONG" && out.stderr.contains(reason),
        "{why}: redis-cli should fail with {reason:?}, got {out:?}"
    );
}

/// What redis-cli says when it does not trust the server's certificate.
const UNTRUSTED: &str = "certificate verify failed";

#[test]
fn the_right_ca_gets_pong_and_the_wrong_ca_is_refused() {
    let pki = TestPki::new();
    let server = RedisTlsServer::start(&pki);
    assert!(server.url().starts_with("rediss://127.0.0.1:"));
    assert!(
        pings(&server, &pki.client_without_cert()),
        "the test CA trusts the server"
    );
    assert_eq!(server.cli(&["PING"]), "PONG");
    assert_refused(
        &server,
        &TlsClient::trusting(pki.other_ca_pem()),
        "trusting the other CA",
        UNTRUSTED,
    );
}

#[test]
fn the_server_listens_with_tls_only() {
    let pki = TestPki::new();
    let server = RedisTlsServer::start(&pki);
    let plain = std::process::Command::new(common::require_binary("redis-cli"))
        .args(["-p", &server.port.to_string(), "PING"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("redis-cli runs");
    assert_ne!(
        String::from_utf8_lossy(&plain.stdout).trim(),
        "PONG",
        "plain redis-cli on the TLS port"
    );
    let config = server.cli(&["CONFIG", "GET", "port"]);
    assert_eq!(
        config.lines().collect::<Vec<_>>(),
        ["port", "0"],
        "no plain listener"
    );
}

#[test]
fn an_expired_server_certificate_is_refused() {
    let pki = TestPki::new();
    let server = RedisTlsServer::start_with(&pki, ServerCert::Expired, ClientAuth::No, &[]);
    assert_refused(&server, &pki.client(), "an expired server certificate", UNTRUSTED);
}

#[test]
fn auth_clients_yes_wants_a_client_certificate_from_the_ca() {
    let pki = TestPki::new();
    let server = RedisTlsServer::start_with(&pki, ServerCert::Good, ClientAuth::Yes, &[]);
    assert_refused(&server, &pki.client_without_cert(), "no client certificate", "");
    let stranger = pki
        .client_without_cert()
        .with_cert(pki.stranger_cert_pem(), pki.stranger_key_pem());
    assert_refused(&server, &stranger, "a client certificate from the other CA", "");
    assert!(
        pings(&server, &pki.client()),
        "the test client certificate gets in"
    );
}

#[test]
fn auth_clients_optional_lets_in_no_certificate_but_not_a_bad_one() {
    let pki = TestPki::new();
    let server = RedisTlsServer::start_with(&pki, ServerCert::Good, ClientAuth::Optional, &[]);
    assert!(
        pings(&server, &pki.client_without_cert()),
        "no client certificate"
    );
    assert!(pings(&server, &pki.client()), "the test client certificate");
    let stranger = pki
        .client_without_cert()
        .with_cert(pki.stranger_cert_pem(), pki.stranger_key_pem());
    assert_refused(&server, &stranger, "a client certificate from the other CA", "");
}

/// What rustls (as a `rediss://` client would) makes of a server certificate for `name`.
fn verify(pki: &TestPki, which: ServerCert, name: &str) -> Result<(), String> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(pki.ca_pem()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .unwrap();
    let cert = CertificateDer::from_pem_file(pki.server_cert_pem(which)).unwrap();
    let name = ServerName::try_from(name.to_string()).unwrap();
    verifier
        .verify_server_cert(&cert, &[], &name, &[], UnixTime::now())
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
}

#[test]
fn the_server_certificates_hold_the_names_and_dates_they_say() {
    let pki = TestPki::new();
    assert_eq!(verify(&pki, ServerCert::Good, "localhost"), Ok(()));
    assert_eq!(verify(&pki, ServerCert::Good, "127.0.0.1"), Ok(()));
    assert_eq!(verify(&pki, ServerCert::OtherName, "other.test"), Ok(()));
    for name in ["127.0.0.1", "localhost"] {
        let err = verify(&pki, ServerCert::OtherName, name).unwrap_err();
        assert!(
            err.contains("NotValidForName"),
            "other.test's certificate for {name}: {err}"
        );
    }
    let err = verify(&pki, ServerCert::Expired, "127.0.0.1").unwrap_err();
    assert!(err.contains("Expired"), "the expired certificate: {err}");
}

#[test]
fn the_misnamed_certificate_is_otherwise_good() {
    // redis-cli checks the chain but not the name: the server with other.test's certificate
    // answers it, so a client that refuses that server refuses it for its name alone.
    let pki = TestPki::new();
    let server = RedisTlsServer::start_with(&pki, ServerCert::OtherName, ClientAuth::No, &[]);
    assert!(
        pings(&server, &pki.client()),
        "other.test's certificate is signed by the CA"
    );
}

#[test]
fn an_acl_user_authenticates_over_tls_with_its_password_only() {
    let pki = TestPki::new();
    let server = RedisTlsServer::start(&pki);
    server.add_user("alice", "s3cret", ALL_RULES);
    assert_eq!(server.cli(&["AUTH", "alice", "s3cret"]), "OK");
    let alice = server.as_user("alice", "s3cret");
    assert_eq!(alice.run(&["ACL", "WHOAMI"]), "alice");
    assert_eq!(alice.run(&["PING"]), "PONG");
    let wrong = server.cli_as(&pki.client(), &["AUTH", "alice", "wrong"]);
    assert!(
        wrong.stdout.contains("WRONGPASS"),
        "AUTH with the wrong password: {wrong:?}"
    );

    server.set_password("alice", "n3w");
    assert!(server.cli(&["AUTH", "alice", "s3cret"]).contains("WRONGPASS"));
    assert_eq!(server.cli(&["AUTH", "alice", "n3w"]), "OK");

    // With the default user off, a connection that does not AUTH gets nothing.
    server.disable_default_user();
    assert!(server.cli(&["PING"]).contains("NOAUTH"), "PING without AUTH");
    let alice = server.as_user("alice", "n3w");
    assert_eq!(alice.run(&["PING"]), "PONG");
    let wrong = server.as_user("alice", "s3cret");
    assert_ne!(wrong.run(&["PING"]), "PONG");
}

#[test]
fn the_acl_helpers_work_on_a_plain_server_and_cut_off_a_users_connections() {
    let redis = RedisServer::start();
    redis.add_user("bob", "pw1", &["~rl:*", "+@all"]);
    // A connection of bob's, held open.
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", redis.port)).unwrap();
    conn.write_all(b"AUTH bob pw1\r\nPING\r\n").unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert_eq!(line, "+OK\r\n");
    line.clear();
    reader.read_line(&mut line).unwrap();
    assert_eq!(line, "+PONG\r\n");

    // A new password leaves the connection in; killing bob's connections ends it.
    let via_closure = |args: &[&str]| redis.cli(args);
    via_closure.set_password("bob", "pw2");
    assert!(redis.cli(&["AUTH", "bob", "pw1"]).contains("WRONGPASS"));
    conn.write_all(b"PING\r\n").unwrap();
    line.clear();
    reader.read_line(&mut line).unwrap();
    assert_eq!(line, "+PONG\r\n", "the connection made with the old password");
    assert_eq!(redis.kill_user_clients("bob"), 1);
    line.clear();
    let _ = conn.write_all(b"PING\r\n");
    let read = reader.read_line(&mut line).unwrap_or(0);
    assert_eq!(read, 0, "bob's connection is closed, got {line:?}");
    assert_eq!(redis.as_user("bob", "pw2").run(&["ACL", "WHOAMI"]), "bob");

    redis.remove_user("bob");
    assert!(redis.cli(&["AUTH", "bob", "pw2"]).contains("WRONGPASS"));
}
