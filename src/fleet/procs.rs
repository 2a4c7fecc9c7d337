//! The processes a fleet run starts (redis-server, the demo upstream, the gateways) and the
//! scratch directory for their rules and logs. Every one is killed when its handle is dropped,
//! so an error or Ctrl-C anywhere leaves nothing behind. The workspace's tests and benches start
//! theirs with the same handles, through `tollgate-testkit`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::{Instant, timeout};

/// How long a process may take to print its address or become ready.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A directory under the system temp dir, removed on drop; or one the user named, kept.
pub struct WorkDir {
    pub path: PathBuf,
    keep: bool,
}

impl WorkDir {
    /// `keep`: a directory to keep (created if missing) instead of a temporary one.
    pub fn new(keep: Option<&Path>) -> Result<WorkDir, String> {
        if let Some(p) = keep {
            std::fs::create_dir_all(p).map_err(|e| format!("--log-dir {}: {e}", p.display()))?;
            return Ok(WorkDir {
                path: p.to_path_buf(),
                keep: true,
            });
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!("tollgate-fleet-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        Ok(WorkDir { path, keep: false })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// A child process, killed on drop; its stderr (and for redis, stdout) goes to `log`.
pub struct Proc {
    pub name: String,
    child: Child,
    pub log: PathBuf,
}

impl Proc {
    fn spawn(
        name: String,
        mut cmd: Command,
        log: PathBuf,
        stdout: bool,
    ) -> Result<(Proc, Option<tokio::process::ChildStdout>), String> {
        let file = std::fs::File::create(&log)
            .map_err(|e| format!("{name}: cannot create {}: {e}", log.display()))?;
        let out = if stdout {
            Stdio::piped()
        } else {
            file.try_clone()
                .map(Stdio::from)
                .map_err(|e| format!("{name}: {e}"))?
        };
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(Stdio::from(file))
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| format!("{name}: cannot start: {e}"))?;
        let so = child.stdout.take();
        Ok((Proc { name, child, log }, so))
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The last lines of the process's log, for an error message. A panic's message comes
    /// first: with `RUST_BACKTRACE` set, the last lines are only the backtrace's frames.
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        excerpt(&text)
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`) with kill(1): the crate forbids unsafe
    /// code, and a signal per second is no hot path.
    pub async fn signal(&self, sig: &str) -> Result<(), String> {
        let pid = self
            .pid()
            .ok_or_else(|| format!("{} has already exited", self.name))?;
        let st = Command::new("kill")
            .args([format!("-{sig}"), pid.to_string()])
            .status()
            .await
            .map_err(|e| format!("kill -{sig} {}: {e}", self.name))?;
        if st.success() {
            Ok(())
        } else {
            Err(format!("kill -{sig} {} ({pid}) failed", self.name))
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`; waits for the exit.
    pub async fn stop(mut self, grace: Duration) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.signal("TERM").await;
            if timeout(grace, self.child.wait()).await.is_err() {
                let _ = self.child.kill().await;
            }
        }
        let _ = self.child.wait().await;
    }

    fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

/// A log's last 15 lines, after the first panic's message and the lines up to its backtrace.
fn excerpt(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let tail_from = lines.len().saturating_sub(15);
    let mut out = Vec::new();
    if let Some(p) = lines.iter().position(|l| l.contains("panicked at"))
        && p < tail_from
    {
        out.extend(
            lines[p..tail_from]
                .iter()
                .take_while(|l| !l.starts_with("stack backtrace:"))
                .take(10),
        );
        out.push("[…]");
    }
    out.extend(&lines[tail_from..]);
    if out.is_empty() {
        "(no output)".into()
    } else {
        out.join("\n")
    }
}

/// Reads lines until one holds `marker` followed by an address; the rest of stdout is drained
/// in the background so the process never blocks on a full pipe.
async fn read_addrs(
    proc: &Proc,
    stdout: tokio::process::ChildStdout,
    markers: &[&str],
) -> Result<Vec<SocketAddr>, String> {
    let mut lines = BufReader::new(stdout).lines();
    let mut found: Vec<Option<SocketAddr>> = vec![None; markers.len()];
    let read = async {
        while found.iter().any(Option::is_none) {
            let Ok(Some(line)) = lines.next_line().await else {
                return false;
            };
            for (i, m) in markers.iter().enumerate() {
                if let Some(rest) = line.strip_prefix(m) {
                    let a = rest.split_whitespace().next().unwrap_or("");
                    found[i] = a.parse().ok();
                }
            }
        }
        true
    };
    let ok = timeout(START_TIMEOUT, read).await.unwrap_or(false);
    if !ok || found.iter().any(Option::is_none) {
        return Err(format!(
            "{} did not print its address ({}); its log:\n{}",
            proc.name,
            markers.join(", "),
            proc.log_tail()
        ));
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(found.into_iter().flatten().collect())
}

/// A `redis-server` this harness started, on a free loopback port without persistence.
pub struct Redis {
    pub proc: Proc,
    pub port: u16,
}

impl Redis {
    pub async fn start(dir: &Path) -> Result<Redis, String> {
        let bin = find_binary("redis-server").ok_or(
            "redis-server is not on PATH: install it (apt-get install redis-server) or pass --redis-url",
        )?;
        let mut last = String::new();
        for attempt in 0..5 {
            let port = free_port().map_err(|e| format!("no free port: {e}"))?;
            let mut cmd = Command::new(&bin);
            cmd.args(redis_server_args(port, dir));
            let (mut proc, _) = Proc::spawn(
                "redis-server".into(),
                cmd,
                dir.join(format!("redis-{attempt}.log")),
                false,
            )?;
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && !proc.exited() {
                if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
                    return Ok(Redis { proc, port });
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            last = proc.log_tail();
            proc.stop(Duration::from_millis(100)).await;
        }
        Err(format!(
            "redis-server did not start on a free port; its log:\n{last}"
        ))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

/// The arguments of a throw-away `redis-server`: loopback only, on `port`, no persistence, its
/// files in `dir`. The fleet harness, the tests and the benches all start Redis this way.
pub fn redis_server_args(port: u16, dir: &Path) -> Vec<String> {
    [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        &dir.to_string_lossy(),
    ]
    .map(String::from)
    .to_vec()
}

/// A port free on loopback now (bind :0, read it, release it).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Where `name` is on PATH (or in the usual system directories).
pub fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/bin", "/usr/sbin", "/usr/local/bin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// `tollgate demo-upstream` on a free loopback port.
pub async fn start_upstream(bin: &Path, dir: &Path) -> Result<(Proc, SocketAddr), String> {
    let mut cmd = Command::new(bin);
    cmd.args(["demo-upstream", "--listen", "127.0.0.1:0"]);
    let (proc, out) = Proc::spawn("demo upstream".into(), cmd, dir.join("upstream.log"), true)?;
    let addr = read_addrs(
        &proc,
        out.expect("piped"),
        &["demo upstream listening on http://"],
    )
    .await?;
    Ok((proc, addr[0]))
}

pub type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// One `tollgate serve` process and the connection pool the load driver keeps to it.
pub struct GatewayProc {
    pub proc: Proc,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub client: HttpClient,
}

/// How every gateway of a run is started.
pub struct GatewaySpec {
    /// The run's label, which names the log files.
    pub run: String,
    pub bin: PathBuf,
    pub rules: PathBuf,
    pub store: String,
    pub fleet_size: u32,
    pub store_timeout: Duration,
    pub threads: u16,
    pub log: String,
}

pub fn client() -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .build(http)
}

impl GatewayProc {
    pub async fn start(setup: &GatewaySpec, index: usize, dir: &Path) -> Result<GatewayProc, String> {
        let mut cmd = Command::new(&setup.bin);
        cmd.arg("serve")
            .arg("--rules")
            .arg(&setup.rules)
            .args(["--store", setup.store.as_str()])
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--fleet-size", &setup.fleet_size.to_string()])
            .args([
                "--store-timeout",
                &format!("{}ms", setup.store_timeout.as_millis()),
            ])
            .args(["--threads", &setup.threads.to_string()])
            .args(["--drain-timeout", "2s"])
            .env("TOLLGATE_LOG", &setup.log)
            // The gateway reads every flag from TOLLGATE_* too; the user's must not leak in.
            .env_remove("TOLLGATE_TLS_CERT")
            .env_remove("TOLLGATE_TLS_KEY")
            .env_remove("TOLLGATE_TRUSTED_PROXY")
            .env_remove("TOLLGATE_CLOCK");
        // Each keeps its own files: twenty gateways must not share one SQLite file in the
        // directory they were started from.
        let files = format!("{}-gateway-{:02}", setup.run.replace('/', "-"), index + 1);
        cmd.arg("--keys-file").arg(dir.join(format!("{files}-keys.db")));
        cmd.arg("--meter-file").arg(dir.join(format!("{files}-usage.db")));
        let name = format!("gateway {}", index + 1);
        let (proc, out) = Proc::spawn(name, cmd, dir.join(format!("{files}.log")), true)?;
        let addrs = read_addrs(
            &proc,
            out.expect("piped"),
            &["tollgate listening on http://", "admin listening on http://"],
        )
        .await?;
        Ok(GatewayProc {
            proc,
            addr: addrs[0],
            admin: addrs[1],
            client: client(),
        })
    }

    /// GETs an admin path; returns the status and body.
    pub async fn admin_get(&self, path: &str) -> Result<(u16, String), String> {
        let uri: http::Uri = format!("http://{}{path}", self.admin)
            .parse()
            .map_err(|e| format!("{e}"))?;
        let resp = timeout(Duration::from_secs(5), self.client.get(uri))
            .await
            .map_err(|_| format!("{}: {path} did not answer in 5 s", self.proc.name))?
            .map_err(|e| format!("{}: {path}: {e}", self.proc.name))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{}: {path}: {e}", self.proc.name))?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    /// Waits until /readyz says `ready` (the store answers), not merely `degraded`.
    pub async fn wait_ready(&self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        let mut last = String::new();
        while Instant::now() < deadline {
            match self.admin_get("/readyz").await {
                Ok((200, body)) if body.contains("\"status\":\"ready\"") => return Ok(()),
                Ok((s, body)) => last = format!("{s} {body}"),
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(format!(
            "{} did not become ready: /readyz said {last}; its log:\n{}",
            self.proc.name,
            self.proc.log_tail()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::excerpt;

    #[test]
    fn a_panic_message_leads_a_long_backtrace() {
        let mut log = vec![
            "starting",
            "thread 'main' panicked at src/x.rs:1:1:",
            "no threads left",
            "stack backtrace:",
        ];
        let frames: Vec<String> = (0..40).map(|i| format!("  {i}: frame")).collect();
        log.extend(frames.iter().map(String::as_str));
        let e = excerpt(&log.join("\n"));
        assert!(
            e.starts_with("thread 'main' panicked at src/x.rs:1:1:\nno threads left\n[…]\n"),
            "{e}"
        );
        assert!(e.ends_with("  39: frame"), "{e}");
        assert!(!e.contains("stack backtrace:"), "{e}");
    }

    #[test]
    fn a_short_log_is_shown_whole_and_an_empty_one_said_so() {
        assert_eq!(excerpt("a\nb"), "a\nb");
        assert_eq!(excerpt(""), "(no output)");
        let short = "thread 'main' panicked at a.rs:1:1:\nboom";
        assert_eq!(excerpt(short), short);
    }
}
