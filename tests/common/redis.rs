//! Real Redis for the tests and benches that need one: a `redis-server` on a free loopback port
//! with no persistence, and a Redis Cluster of three masters (with a replica of each, if asked),
//! each stopped when dropped.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, require_binary};

/// A real `redis-server` on a free loopback port, with no persistence; killed on drop.
pub struct RedisServer {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts redis-server on `port` and waits until it listens; `None` if it exits or
    /// doesn't listen within 5 s (another process may have taken the port).
    fn try_start(
        port: u16,
        dir: tempfile::TempDir,
        extra: &[String],
    ) -> Result<RedisServer, tempfile::TempDir> {
        let mut child = Command::new(require_binary("redis-server"))
            .args(tollgate_testkit::redis_server_args(port, dir.path()))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(RedisServer {
                    port,
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
        Err(dir)
    }

    /// A server on a given port (one a test reserved and left free on purpose).
    pub fn start_on(port: u16) -> RedisServer {
        RedisServer::try_start(port, tempfile::tempdir().unwrap(), &[])
            .unwrap_or_else(|_| panic!("redis-server did not start on port {port}"))
    }

    pub fn start_with(extra: &[&str]) -> RedisServer {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        RedisServer::start_with_fn(|| extra.clone())
    }

    /// Like `start_with`, with arguments made afresh for each attempt (a new free port each).
    pub fn start_with_fn(extra: impl Fn() -> Vec<String>) -> RedisServer {
        let mut dir = tempfile::tempdir().unwrap();
        for _ in 0..5 {
            match RedisServer::try_start(free_port(), dir, &extra()) {
                Ok(server) => return server,
                Err(d) => dir = d,
            }
        }
        panic!("redis-server did not start on a free port");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the server with SIGKILL, as a crash would, and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Runs `redis-cli` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(require_binary("redis-cli"))
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Runs a hash command on the bucket `key` where the store keeps it, its field of its page
    /// (`lua/bucket.lua`): `bucket("HEXISTS", key)`, `bucket("HGET", key)`, `bucket("HSTRLEN",
    /// key)`, or `bucket_with("HSET", key, &[value])`.
    pub fn bucket(&self, command: &str, key: &str) -> String {
        self.bucket_with(command, key, &[])
    }

    /// The names of every bucket the store holds whose name starts with `prefix`, sorted: the
    /// fields of every page.
    pub fn bucket_names(&self, prefix: &str) -> Vec<String> {
        let mut names: Vec<String> = self
            .cli(&["--scan", "--pattern", "rl:page:*"])
            .lines()
            .filter(|p| !p.is_empty())
            .flat_map(|page| {
                self.cli(&["HKEYS", page])
                    .lines()
                    .map(String::from)
                    .collect::<Vec<_>>()
            })
            .filter(|n| n.starts_with(prefix))
            .collect();
        names.sort();
        names
    }

    pub fn bucket_with(&self, command: &str, key: &str, rest: &[&str]) -> String {
        let page = tollgate_store::page::page_of(key);
        let mut args = vec![command, page.as_str(), key];
        args.extend_from_slice(rest);
        self.cli(&args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Redis Cluster of three masters (and, from [`RedisCluster::with_replicas`], a replica of
/// each), each a `RedisServer` on free ports (client and bus); stopped on drop.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Three masters, no replicas, a node timeout of 5 s.
    pub fn start() -> RedisCluster {
        RedisCluster::start_as(0, 5_000, &[])
    }

    /// Three masters and one replica each, failing over after `node_timeout_ms` of silence.
    /// `cluster-require-full-coverage no`: while one master is down and not yet replaced, the
    /// other masters keep serving their slots rather than the whole cluster refusing.
    pub fn with_replicas(node_timeout_ms: u32) -> RedisCluster {
        RedisCluster::start_as(1, node_timeout_ms, &["--cluster-require-full-coverage", "no"])
    }

    /// `masters` masters and no replicas, a node timeout of 5 s: the slots split evenly.
    pub fn with_masters(masters: usize) -> RedisCluster {
        RedisCluster::start_n(masters, 0, 5_000, &[])
    }

    fn start_as(replicas: usize, node_timeout_ms: u32, extra: &[&str]) -> RedisCluster {
        RedisCluster::start_n(3, replicas, node_timeout_ms, extra)
    }

    fn start_n(masters: usize, replicas: usize, node_timeout_ms: u32, extra: &[&str]) -> RedisCluster {
        let count = masters * (1 + replicas);
        let nodes: Vec<RedisServer> = (0..count)
            .map(|_| {
                RedisServer::start_with_fn(|| {
                    let mut args = [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        &node_timeout_ms.to_string(),
                        "--cluster-port",
                        &free_port().to_string(),
                    ]
                    .map(String::from)
                    .to_vec();
                    args.extend(extra.iter().map(|s| s.to_string()));
                    args
                })
            })
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        if count == 1 {
            // `redis-cli --cluster create` wants three masters; one node takes every slot itself.
            let added = nodes[0].cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
            assert_eq!(added, "OK", "CLUSTER ADDSLOTSRANGE on a one-node cluster");
        } else {
            let out = Command::new(require_binary("redis-cli"))
                .args(["--cluster", "create"])
                .args(&addrs)
                .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
                .output()
                .expect("redis-cli --cluster create runs");
            assert!(
                out.status.success(),
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let cluster = RedisCluster { nodes };
        let known = format!("cluster_known_nodes:{count}");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = cluster.nodes.iter().all(|n| {
                let info = n.cli(&["CLUSTER", "INFO"]);
                let synced = n.cli(&["ROLE"]).starts_with("master")
                    || n.cli(&["INFO", "replication"]).contains("master_link_status:up");
                info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_ok:16384")
                    && info.contains(&known)
                    && synced
            });
            if ready {
                return cluster;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster of {count} nodes did not become ready in 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis-cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
    pub fn url(&self) -> String {
        format!("redis-cluster://{}", self.node_list().join(","))
    }

    pub fn node_list(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect()
    }

    /// Runs `redis-cli -c` (following redirections) against the first node.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(require_binary("redis-cli"))
            .args(["-c", "-p", &self.nodes[0].port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}
