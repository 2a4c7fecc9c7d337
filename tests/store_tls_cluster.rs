//! A Redis Cluster that speaks TLS only, as a managed one does: three `redis-server` masters with
//! no plain listener (`port 0`, `tls-port`), whose cluster bus and replication are TLS too, and
//! real gateway processes with `--store rediss-cluster://SEED`. Only one seed is named: the other
//! masters are found through the cluster's slot map and reached with the same TLS settings, so a
//! bucket in a slot the seed does not serve is only reachable that way. Two gateways share one
//! limit through it, a request whose buckets lie in two slots on two masters pays both, and
//! `check-store` refuses the cluster without the CA that signed it.

mod common;

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::redis_tls::{ServerCert, TestPki};
use common::{Http, Tollgate, free_port, require_binary};
use http::{Method, StatusCode};

/// One master of [`TlsCluster`]: a TLS-only `redis-server` with the cluster on; killed on drop.
struct TlsNode {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for TlsNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port `P` free now whose cluster bus port `P + 10000` (what redis-server takes with
/// `tls-port P` and `port 0`) is a port number and free too.
fn free_port_and_bus() -> u16 {
    for _ in 0..200 {
        let port = free_port();
        if port <= 55_535 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port P with P + 10000 free too");
}

/// Starts a node with the test PKI's good certificate (`tls-auth-clients no`), cluster on with
/// its own nodes file, bus and replication over TLS; once both its TLS port and its bus port
/// accept TCP. Retries on new ports if another process took one meanwhile.
fn start_node(pki: &TestPki) -> TlsNode {
    let mut log = String::new();
    for _ in 0..5 {
        let port = free_port_and_bus();
        let dir = tempfile::tempdir().unwrap();
        let logfile = dir.path().join("redis.log");
        let nodes_conf = dir.path().join("nodes.conf");
        let mut child = Command::new(require_binary("redis-server"))
            .args(tollgate_testkit::redis_server_args(0, dir.path()))
            .arg("--tls-port")
            .arg(port.to_string())
            .arg("--tls-cert-file")
            .arg(pki.server_cert_pem(ServerCert::Good))
            .arg("--tls-key-file")
            .arg(pki.server_key_pem(ServerCert::Good))
            .arg("--tls-ca-cert-file")
            .arg(pki.ca_pem())
            .args(["--tls-auth-clients", "no"])
            // The cluster bus asks a connecting node for a certificate whatever
            // `tls-auth-clients` says; the server certificate is for server auth only.
            .arg("--tls-client-cert-file")
            .arg(pki.client_cert_pem())
            .arg("--tls-client-key-file")
            .arg(pki.client_key_pem())
            .args(["--cluster-enabled", "yes"])
            .args(["--tls-cluster", "yes"])
            .args(["--tls-replication", "yes"])
            .arg("--cluster-config-file")
            .arg(&nodes_conf)
            .args(["--cluster-node-timeout", "2000"])
            .arg("--logfile")
            .arg(&logfile)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let up = |p: u16| TcpStream::connect(("127.0.0.1", p)).is_ok();
            if up(port) && up(port + 10_000) && matches!(child.try_wait(), Ok(None)) {
                return TlsNode {
                    port,
                    child,
                    _dir: dir,
                };
            }
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        log = std::fs::read_to_string(&logfile).unwrap_or_default();
    }
    panic!("a TLS cluster node did not start on free ports; its log:\n{log}");
}

/// Three TLS-only masters holding every slot between them; stopped on drop.
struct TlsCluster {
    pki: TestPki,
    nodes: Vec<TlsNode>,
}

impl TlsCluster {
    fn start() -> TlsCluster {
        let pki = TestPki::new();
        let nodes: Vec<TlsNode> = (0..3).map(|_| start_node(&pki)).collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        // `--cluster create` waits without end for nodes that never meet: bound it.
        let out_dir = tempfile::tempdir().unwrap();
        let (out_path, err_path) = (out_dir.path().join("out"), out_dir.path().join("err"));
        let mut create = Command::new(require_binary("redis-cli"))
            .arg("--tls")
            .arg("--cacert")
            .arg(pki.ca_pem())
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(std::fs::File::create(&err_path).unwrap())
            .spawn()
            .expect("redis-cli --cluster create runs");
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = create.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = create.kill();
                let _ = create.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(
            status.is_some_and(|s| s.success()),
            "redis-cli --tls --cluster create {} ({status:?}): {}{}",
            if status.is_none() {
                "still ran after 60 s"
            } else {
                "failed"
            },
            std::fs::read_to_string(&out_path).unwrap_or_default(),
            std::fs::read_to_string(&err_path).unwrap_or_default()
        );
        let cluster = TlsCluster { pki, nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let infos: Vec<String> = (0..3).map(|i| cluster.cli(i, &["CLUSTER", "INFO"])).collect();
            let ready = infos.iter().all(|info| {
                info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_ok:16384")
                    && info.contains("cluster_known_nodes:3")
            });
            if ready {
                return cluster;
            }
            assert!(
                Instant::now() < deadline,
                "the TLS cluster did not become ready in 30 s: {infos:#?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn ca(&self) -> String {
        path(self.pki.ca_pem())
    }

    fn addr(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.nodes[i].port)
    }

    /// `redis-cli --tls --cacert CA` against node `i` (no redirections followed): its stdout.
    fn cli(&self, i: usize, args: &[&str]) -> String {
        let out = Command::new(require_binary("redis-cli"))
            .arg("--tls")
            .arg("--cacert")
            .arg(self.pki.ca_pem())
            .args(["-h", "127.0.0.1", "-p", &self.nodes[i].port.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// The node that serves the page of bucket `key`: the one that does not answer `MOVED`.
    fn owner(&self, key: &str) -> usize {
        let page = tollgate_store::page::page_of(key);
        let owners: Vec<usize> = (0..3)
            .filter(|&i| !self.cli(i, &["EXISTS", &page]).contains("MOVED"))
            .collect();
        assert_eq!(owners.len(), 1, "one master serves {page}: {owners:?}");
        owners[0]
    }

    /// The names of the buckets node `i` holds: the fields of every page it keeps.
    fn buckets_on(&self, i: usize) -> Vec<String> {
        let pages = self.cli(i, &["KEYS", "rl:page:*"]);
        pages
            .lines()
            .filter(|p| !p.is_empty())
            .flat_map(|page| {
                self.cli(i, &["HKEYS", page])
                    .lines()
                    .map(String::from)
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

fn path(p: PathBuf) -> String {
    p.to_str().unwrap().to_string()
}

/// The demo's rules with k-7's plan at a burst of 10 and one token a minute (two gateways that
/// share the bucket admit 10 of 40 between them, two that don't 20), and a wide `unauth` limit,
/// so that the login limit alone decides `/login` (5 a minute per account, burst 5).
fn tight_rules() -> (tempfile::TempDir, PathBuf) {
    let mut rules: serde_json::Value = serde_json::from_str(&common::demo_json()).unwrap();
    for k in rules["keys"].as_array_mut().unwrap() {
        if k["id"] == "k-7" {
            k["limits"]["plan"] = serde_json::json!({"rate": "1/60s", "burst": 10});
        }
    }
    let login = &rules["limits"]["login"];
    assert_eq!(
        (login["rate"].as_str(), login["burst"].as_u64()),
        (Some("5/60s"), Some(5)),
        "the demo's login limit: {login}"
    );
    rules["limits"]["unauth"]["rate"] = "1000/1s".into();
    rules["limits"]["unauth"]["burst"] = 1000.into();
    common::rules_file(&rules.to_string())
}

/// `tollgate check-store` with `args`: (exit success, stdout, stderr).
fn check_store(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(common::gateway_bin())
        .arg("check-store")
        .args(args)
        .output()
        .expect("tollgate check-store runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_share_limits_on_a_tls_cluster_named_by_one_seed() {
    let cluster = TlsCluster::start();
    // The seed is a master that does not serve k-7's bucket: every k-7 request is decided on a
    // master the gateways only know from the slot map.
    let k7_owner = cluster.owner("rl:{k7}:plan");
    let seed = (0..3).find(|&i| i != k7_owner).unwrap();
    // An account whose login bucket lies on another master than the client IP's bucket.
    let ip_bucket = "rl:{ip:127.0.0.1}:unauth";
    let ip_owner = cluster.owner(ip_bucket);
    let (account, login_bucket, login_owner) = (1..50)
        .map(|n| {
            let a = format!("a{n}");
            let bucket = format!("rl:{{h:{a}}}:login");
            let owner = cluster.owner(&bucket);
            (a, bucket, owner)
        })
        .find(|(_, _, owner)| *owner != ip_owner)
        .expect("an account whose login bucket is on another master than the IP's");
    assert_ne!(
        tollgate_store::slots::cluster_slot(login_bucket.as_bytes()),
        tollgate_store::slots::cluster_slot(ip_bucket.as_bytes())
    );

    let (_dir, rules) = tight_rules();
    let ca = cluster.ca();
    let url = format!("rediss-cluster://{}", cluster.addr(seed));
    let args = [
        "demo",
        "--rules",
        rules.to_str().unwrap(),
        "--store",
        &url,
        "--store-ca",
        &ca,
    ];
    let a = Tollgate::spawn(&args);
    let b = Tollgate::spawn(&args);
    let http = Http::new();

    let mut admitted = 0;
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..40 {
        let gw = if i % 2 == 0 { &a } else { &b };
        let r = http
            .get(&gw.url("/v1/orders"), &[("authorization", "Bearer k7-demo-key")])
            .await;
        *statuses.entry(r.status.as_u16()).or_insert(0) += 1;
        if r.status == StatusCode::OK {
            admitted += 1;
        }
    }
    assert!(
        (10..=11).contains(&admitted),
        "two gateways on one TLS cluster admitted {admitted} of 40 ({statuses:?}); one bucket admits 10 or 11, two 20"
    );
    assert_eq!(statuses.len(), 2, "only 200s and 429s: {statuses:?}");
    assert!(statuses.contains_key(&429), "{statuses:?}");

    // POST /login without a key pays the account's bucket and the IP's: two slots, two masters.
    let mut logins = Vec::new();
    for i in 0..8 {
        let gw = if i % 2 == 0 { &a } else { &b };
        let r = http
            .send(Method::POST, &gw.url("/login"), &[("x-account", &account)], b"")
            .await;
        logins.push(r);
    }
    let codes: Vec<u16> = logins.iter().map(|r| r.status.as_u16()).collect();
    assert_eq!(
        codes,
        [200, 200, 200, 200, 200, 429, 429, 429],
        "{account}'s login limit (burst 5, 5 a minute) over two gateways: {:?}",
        logins.iter().map(|r| r.body_text()).collect::<Vec<_>>()
    );
    for r in &logins[5..] {
        assert_eq!(r.json()["limit"], "login", "{}", r.body_text());
    }

    // The buckets are where the slot map says, written over the only listeners there are: TLS.
    let held: Vec<Vec<String>> = (0..3).map(|i| cluster.buckets_on(i)).collect();
    for (bucket, owner) in [
        ("rl:{k7}:plan", k7_owner),
        (login_bucket.as_str(), login_owner),
        (ip_bucket, ip_owner),
    ] {
        for (i, names) in held.iter().enumerate() {
            assert_eq!(
                names.iter().any(|n| n == bucket),
                i == owner,
                "{bucket} belongs on master {owner} only (seed {seed}): {held:?}"
            );
        }
    }
    let clients = cluster.cli(k7_owner, &["CLIENT", "LIST"]);
    assert!(
        clients.lines().count() >= 3,
        "both gateways hold connections to k-7's master (not the seed): {clients}"
    );

    for gw in [&a, &b] {
        let log = gw.stderr_when(|l| l.contains("store found")).await;
        let found = log
            .lines()
            .find(|l| l.contains("store found"))
            .unwrap_or_else(|| panic!("no start-up line about the store in {log}"));
        assert!(
            found.contains(&format!("redis-cluster at {url}"))
                && found.contains("3 primaries")
                && found.contains("; TLS;"),
            "{found}"
        );
        for i in 0..3 {
            assert!(found.contains(&cluster.addr(i)), "master {i} missing: {found}");
        }
    }
}

#[test]
fn check_store_on_a_tls_cluster_needs_its_ca() {
    let cluster = TlsCluster::start();
    let url = format!("rediss-cluster://{}", cluster.addr(0));

    // The built-in roots don't hold the test CA.
    let (ok, out, err) = check_store(&["--store", &url]);
    assert!(!ok, "check-store passed without the CA: {out}");
    assert!(err.contains("TLS to the Redis store"), "{err}");

    let (ok, out, err) = check_store(&["--store", &url, "--store-ca", &cluster.ca()]);
    assert!(ok, "check-store with the CA failed: {err}");
    let line = out
        .lines()
        .find(|l| l.contains("3 primaries"))
        .unwrap_or_else(|| panic!("no line with 3 primaries in {out}"));
    assert!(
        line.contains(&format!("redis-cluster at {url}")) && line.contains("; TLS;"),
        "{line}"
    );
    for i in 0..3 {
        assert!(line.contains(&cluster.addr(i)), "master {i} missing: {line}");
    }
}
