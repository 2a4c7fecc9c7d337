//! A real Redis Sentinel deployment, for the tests of `redis-sentinel://` stores: a primary and
//! one replica (`redis-server`, no persistence) and three sentinels (`redis-server --sentinel`)
//! that watch them as the service `mymaster`, each on a free loopback port and in a directory of
//! its own (a sentinel rewrites its config file). Data nodes can be killed as a crash would and
//! started again on their port; everything is killed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, require_binary};

/// The service name the sentinels watch.
pub const SERVICE: &str = "mymaster";

/// How long [`RedisSentinels::start`] waits for the sentinels to agree on the deployment.
const READY_WITHIN: Duration = Duration::from_secs(15);

/// How many lines of each log a failure shows.
const LOG_TAIL: usize = 60;

/// One `redis-server` holding data: its port and directory, kept across restarts, the
/// arguments it was first started with, and its process while it runs.
struct DataNode {
    port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
    child: Option<Child>,
}

impl DataNode {
    fn log(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    /// Starts redis-server on `port` in `dir`; its log's end if it does not listen in 5 s.
    fn spawn(port: u16, dir: &Path, extra: &[String]) -> Result<Child, String> {
        let mut cmd = Command::new(require_binary("redis-server"));
        cmd.args(tollgate_testkit::redis_server_args(port, dir))
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            // A primary otherwise waits 5 s for more replicas before each full sync.
            .args(["--repl-diskless-sync-delay", "0"])
            .args(extra);
        launch(cmd, port, &dir.join("redis.log"))
    }

    /// A node on a free port, trying five; `extra` (e.g. `--replicaof`) after the rest.
    fn start(extra: Vec<String>) -> DataNode {
        let dir = tempfile::tempdir().expect("tempdir for redis-server");
        let mut log = String::new();
        for _ in 0..5 {
            let port = free_port();
            match DataNode::spawn(port, dir.path(), &extra) {
                Ok(child) => {
                    return DataNode {
                        port,
                        dir,
                        extra,
                        child: Some(child),
                    };
                }
                Err(l) => log = l,
            }
        }
        panic!("redis-server {extra:?} did not start on a free port; its log:\n{log}");
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One sentinel: its port, the directory of its config file and log, its process.
struct Sentinel {
    port: u16,
    dir: tempfile::TempDir,
    child: Child,
}

impl Sentinel {
    fn log(&self) -> PathBuf {
        self.dir.path().join("sentinel.log")
    }

    /// A sentinel on a free port (trying five) that watches the primary on `primary` as
    /// [`SERVICE`] with quorum 2, with a config file of its own written afresh each try.
    fn start(primary: u16, down_after_ms: u64, failover_timeout_ms: u64) -> Sentinel {
        let dir = tempfile::tempdir().expect("tempdir for a sentinel");
        let conf = dir.path().join("sentinel.conf");
        let logfile = dir.path().join("sentinel.log");
        let mut log = String::new();
        for _ in 0..5 {
            let port = free_port();
            let text = format!(
                "port {port}\n\
                 bind 127.0.0.1\n\
                 dir {dir}\n\
                 logfile {logfile}\n\
                 sentinel resolve-hostnames no\n\
                 sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n\
                 sentinel failover-timeout {SERVICE} {failover_timeout_ms}\n\
                 sentinel parallel-syncs {SERVICE} 1\n",
                dir = dir.path().display(),
                logfile = logfile.display(),
            );
            std::fs::write(&conf, text).expect("write sentinel.conf");
            let mut cmd = Command::new(require_binary("redis-server"));
            cmd.arg(&conf).arg("--sentinel");
            match launch(cmd, port, &logfile) {
                Ok(child) => return Sentinel { port, dir, child },
                Err(l) => log = l,
            }
        }
        panic!("a sentinel did not start on a free port; its log:\n{log}");
    }
}

/// Spawns `cmd` (quiet) and waits until it accepts TCP on `port`; if it exits or does not
/// within 5 s (another process may have taken the port), kills it and returns `log`'s end.
fn launch(mut cmd: Command, port: u16, log: &Path) -> Result<Child, String> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn redis-server");
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(child);
        }
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    Err(tail(log))
}

/// The last [`LOG_TAIL`] lines of a log, or a note that there is none.
fn tail(path: &Path) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(LOG_TAIL)..].join("\n")
        }
        Err(e) => format!("(no log at {}: {e})", path.display()),
    }
}

/// Runs `redis-cli -h 127.0.0.1 -p port args...` and returns what it printed, trimmed.
fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new(require_binary("redis-cli"))
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The value of `field` in an `INFO` answer (`field:value` lines).
fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines()
        .map(|l| l.trim_end_matches('\r'))
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
}

/// Whether a flattened `SENTINEL replicas`/`SENTINEL sentinels` answer (one field or value a
/// line) has `key` followed by `value`.
fn has_pair(answer: &str, key: &str, value: &str) -> bool {
    let lines: Vec<&str> = answer.lines().map(str::trim).collect();
    lines.windows(2).any(|w| w[0] == key && w[1] == value)
}

/// A primary, one replica and three sentinels that watch them as [`SERVICE`] with quorum 2,
/// all on loopback; killed on drop. Ports are `127.0.0.1` ports throughout: the sentinels see
/// the replica and each other at the addresses they connect from, so nothing is announced.
pub struct RedisSentinels {
    data: Vec<DataNode>,
    sentinels: Vec<Sentinel>,
    /// The port [`RedisSentinels::kill_primary`] last killed, and when.
    last_kill: Option<(u16, Instant)>,
}

impl RedisSentinels {
    /// Starts the primary, then its replica (`--replicaof 127.0.0.1 <primary>`) and waits for
    /// `master_link_status:up`, then three sentinels with `down-after-milliseconds`
    /// `down_after_ms`, `failover-timeout` `failover_timeout_ms` and `parallel-syncs 1`. Returns
    /// once every sentinel names the primary and knows the replica and the other two sentinels;
    /// fails the test with the sentinels' logs if that takes more than 15 s.
    pub fn start(down_after_ms: u64, failover_timeout_ms: u64) -> RedisSentinels {
        let primary = DataNode::start(vec![]);
        let replica = DataNode::start(
            ["--replicaof", "127.0.0.1", &primary.port.to_string()]
                .map(String::from)
                .to_vec(),
        );
        let mut deployment = RedisSentinels {
            data: vec![primary, replica],
            sentinels: vec![],
            last_kill: None,
        };
        let (primary, replica) = (deployment.data[0].port, deployment.data[1].port);
        let synced = poll(Duration::from_secs(10), || {
            let info = redis_cli(replica, &["INFO", "replication"]);
            info_field(&info, "master_link_status") == Some("up")
        });
        assert!(
            synced,
            "the replica on {replica} did not sync with the primary on {primary} in 10 s; {}",
            deployment.data_logs()
        );
        deployment.sentinels = (0..3)
            .map(|_| Sentinel::start(primary, down_after_ms, failover_timeout_ms))
            .collect();
        let ports = deployment.sentinel_ports();
        let ready = poll(READY_WITHIN, || {
            ports.iter().all(|&s| {
                let replicas = redis_cli(s, &["SENTINEL", "replicas", SERVICE]);
                let peers = redis_cli(s, &["SENTINEL", "sentinels", SERVICE]);
                sentinel_names(s) == Some(primary)
                    && has_pair(&replicas, "name", &format!("127.0.0.1:{replica}"))
                    && has_pair(&replicas, "flags", "slave")
                    && ports
                        .iter()
                        .filter(|&&p| p != s)
                        .all(|p| has_pair(&peers, "port", &p.to_string()))
            })
        });
        if !ready {
            let views: Vec<String> = ports
                .iter()
                .map(|&s| {
                    format!(
                        "sentinel {s} names {:?}; its replicas:\n{}\nits sentinels:\n{}",
                        sentinel_names(s),
                        redis_cli(s, &["SENTINEL", "replicas", SERVICE]),
                        redis_cli(s, &["SENTINEL", "sentinels", SERVICE]),
                    )
                })
                .collect();
            panic!(
                "the sentinels did not agree on primary {primary}, replica {replica} and each other in {READY_WITHIN:?}:\n{}\n{}",
                views.join("\n"),
                deployment.sentinel_logs()
            );
        }
        deployment
    }

    /// `redis-sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/mymaster`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinel_ports()
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis-sentinel://{}/{SERVICE}", hosts.join(","))
    }

    /// The sentinels' ports, in the order of [`RedisSentinels::url`].
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|s| s.port).collect()
    }

    /// The two data nodes' ports: the first primary's, then the first replica's.
    pub fn data_ports(&self) -> [u16; 2] {
        [self.data[0].port, self.data[1].port]
    }

    /// The primary's port as the sentinels name it now: the first sentinel that answers
    /// `SENTINEL get-master-addr-by-name mymaster`. Fails the test if none does.
    pub fn primary_port(&self) -> u16 {
        self.sentinel_ports()
            .into_iter()
            .find_map(sentinel_names)
            .unwrap_or_else(|| panic!("no sentinel names a primary; {}", self.sentinel_logs()))
    }

    /// What each sentinel names as the primary now, in the order of
    /// [`RedisSentinels::sentinel_ports`] (`None`: no answer, or not an address).
    pub fn named_primaries(&self) -> Vec<Option<u16>> {
        self.sentinel_ports().into_iter().map(sentinel_names).collect()
    }

    /// Kills the current primary (whichever data node the sentinels name) with SIGKILL, as a
    /// crash would, reaps it, and returns its port.
    pub fn kill_primary(&mut self) -> u16 {
        let port = self.primary_port();
        let node = self
            .data
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("the sentinels name {port}, which is no data node of theirs"));
        assert!(node.child.is_some(), "the primary on {port} is not running");
        node.kill();
        self.last_kill = Some((port, Instant::now()));
        port
    }

    /// Starts the data node of `port` again, on that port and in its directory, with the
    /// arguments it was first started with (the first primary: none, so it comes back as a
    /// primary of nothing until the sentinels make it a replica; see
    /// [`RedisSentinels::wait_replica_of`]). Kills it first if it runs. Fails the test if it
    /// does not listen within 5 s.
    pub fn restart(&mut self, port: u16) {
        let node = self
            .data
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no data node on {port}"));
        node.kill();
        match DataNode::spawn(port, node.dir.path(), &node.extra) {
            Ok(child) => node.child = Some(child),
            Err(log) => panic!("redis-server did not start again on {port}; its log:\n{log}"),
        }
    }

    /// Waits until every sentinel names one same primary other than `old_port`, and returns how
    /// long the failover took: from [`RedisSentinels::kill_primary`] if that is how `old_port`
    /// went down, else from this call. Fails the test with what each sentinel names and their
    /// logs if that takes more than `timeout` (counted from this call).
    pub fn wait_failover(&self, old_port: u16, timeout: Duration) -> Duration {
        let called = Instant::now();
        let since = match self.last_kill {
            Some((port, at)) if port == old_port => at,
            _ => called,
        };
        let done = poll(timeout, || {
            let named = self.named_primaries();
            matches!(named[0], Some(p) if p != old_port) && named.iter().all(|n| *n == named[0])
        });
        if !done {
            panic!(
                "the sentinels did not fail over from {old_port} in {timeout:?}: they name {:?}\n{}",
                self.named_primaries(),
                self.sentinel_logs()
            );
        }
        since.elapsed()
    }

    /// Waits until the data node on `port` is a replica of the one on `primary_port` (`INFO
    /// replication`: `role:slave`, `master_port:<primary_port>`) and in sync with it
    /// (`master_link_status:up`); returns how long that took. Fails the test with the logs if
    /// that takes more than `timeout`.
    pub fn wait_replica_of(&self, port: u16, primary_port: u16, timeout: Duration) -> Duration {
        let start = Instant::now();
        let primary = primary_port.to_string();
        let done = poll(timeout, || {
            let info = redis_cli(port, &["INFO", "replication"]);
            info_field(&info, "role") == Some("slave")
                && info_field(&info, "master_port") == Some(primary.as_str())
                && info_field(&info, "master_link_status") == Some("up")
        });
        if !done {
            panic!(
                "{port} did not become a replica of {primary_port} in {timeout:?}; its INFO replication:\n{}\n{}\n{}",
                redis_cli(port, &["INFO", "replication"]),
                self.data_logs(),
                self.sentinel_logs()
            );
        }
        start.elapsed()
    }

    /// Waits until the two data nodes are settled: the sentinels agree on a primary, and the
    /// other node is its replica, in sync. Returns `(primary, replica)`. On a loaded machine
    /// the sentinels may fail over again while a node restarts (a primary that misses its
    /// PINGs for `down-after-milliseconds` is down to them), so which node ends primary is
    /// theirs to say; what holds is that there is one, and one replica of it.
    pub fn wait_settled(&self, timeout: Duration) -> (u16, u16) {
        let [a, b] = self.data_ports();
        let mut settled = None;
        let done = poll(timeout, || {
            let named = self.named_primaries();
            let Some(Some(p)) = named.first().copied() else {
                return false;
            };
            if named.iter().any(|n| *n != Some(p)) {
                return false;
            }
            let replica = if p == a { b } else { a };
            let info = redis_cli(replica, &["INFO", "replication"]);
            let ok = info_field(&info, "role") == Some("slave")
                && info_field(&info, "master_port") == Some(p.to_string().as_str())
                && info_field(&info, "master_link_status") == Some("up")
                && info_field(&redis_cli(p, &["INFO", "replication"]), "role") == Some("master");
            if ok {
                settled = Some((p, replica));
            }
            ok
        });
        match (done, settled) {
            (true, Some(pair)) => pair,
            _ => panic!(
                "the data nodes did not settle as a primary and its replica in {timeout:?}\n{}\n{}",
                self.data_logs(),
                self.sentinel_logs()
            ),
        }
    }

    /// Runs `redis-cli -h 127.0.0.1 -p port args...` against any data node or sentinel and
    /// returns what it printed, trimmed. (`|args: &[&str]| sentinels.cli(port, args)` is a
    /// `RedisCli` of `common::redis_tls`.)
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        redis_cli(port, args)
    }

    /// The end of every sentinel's log, for a failure's message.
    pub fn sentinel_logs(&self) -> String {
        self.sentinels
            .iter()
            .map(|s| format!("--- sentinel {} log:\n{}", s.port, tail(&s.log())))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The end of every data node's log, for a failure's message.
    pub fn data_logs(&self) -> String {
        self.data
            .iter()
            .map(|n| format!("--- redis-server {} log:\n{}", n.port, tail(&n.log())))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Polls `ready` every 50 ms until it holds (true) or `timeout` passes (false).
fn poll(timeout: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The primary's port the sentinel on `port` names (`SENTINEL get-master-addr-by-name`).
fn sentinel_names(port: u16) -> Option<u16> {
    let out = redis_cli(port, &["SENTINEL", "get-master-addr-by-name", SERVICE]);
    let mut lines = out.lines().map(str::trim);
    match (lines.next(), lines.next()) {
        (Some("127.0.0.1"), Some(p)) => p.parse().ok(),
        _ => None,
    }
}

impl Drop for RedisSentinels {
    fn drop(&mut self) {
        for s in &mut self.sentinels {
            let _ = s.child.kill();
            let _ = s.child.wait();
        }
        for n in &mut self.data {
            n.kill();
        }
    }
}
