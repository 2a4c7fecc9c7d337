//! Tollgate as a process, for the tests and benches that run the binary itself: a `tollgate`
//! process killed on drop, a `tollgate demo-upstream` with its workers, a `serve` expected to
//! exit, and the memory and CPU a process has used, read from /proc.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::rules_file;

/// The gateway binary spawned as `Tollgate`: this build's, or the one `TOLLGATE_BIN` names, so a
/// bench can measure another commit's build beside this one in one run (benches/README.md).
pub fn gateway_bin() -> std::ffi::OsString {
    std::env::var_os("TOLLGATE_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_tollgate").into())
}

/// Runs `tollgate serve --rules <rules>` expecting it to exit; returns (success, stderr).
pub fn serve_and_exit(rules: &str, args: &[&str]) -> (bool, String) {
    let (dir, rules) = rules_file(rules);
    let meter_file = dir.path().join("usage.db");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "serve",
            "--rules",
            rules.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--meter-file",
            meter_file.to_str().unwrap(),
        ])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            return (status.success(), err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tollgate {args:?} was expected to exit but still runs after 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `tollgate` process; killed on drop unless it already exited.
pub struct Tollgate {
    pub child: Child,
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
    pub stderr_path: PathBuf,
    /// Every line it printed on stdout so far.
    stdout: Arc<std::sync::Mutex<Vec<String>>>,
    drain: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Tollgate {
    /// Starts `tollgate <args>` with `--listen 127.0.0.1:0` and waits for its address.
    pub fn spawn(args: &[&str]) -> Tollgate {
        Tollgate::spawn_with_env(args, &[])
    }

    /// [`Tollgate::spawn`] with extra environment variables (`TOLLGATE_LOG`, say).
    pub fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Tollgate {
        Tollgate::spawn_with_stderr(args, env, None)
    }

    /// [`Tollgate::spawn_with_env`] with stderr sent to `stderr` (a pipe the test takes from
    /// `child.stderr`, say) instead of the file [`Tollgate::stderr`] reads.
    pub fn spawn_with_stderr(args: &[&str], env: &[(&str, &str)], stderr: Option<Stdio>) -> Tollgate {
        let dir = tempfile::tempdir().unwrap();
        let stderr_path = dir.path().join("stderr.log");
        let file = std::fs::File::create(&stderr_path).unwrap();
        let stderr = stderr.unwrap_or_else(|| file.into());
        // Usage records of the embedded store go to the test's own directory.
        let meter_file = dir.path().join("usage.db");
        let meter_args: Vec<&str> = if args.contains(&"--meter-file") {
            vec![]
        } else {
            vec!["--meter-file", meter_file.to_str().unwrap()]
        };
        let mut child = Command::new(gateway_bin())
            .args(args)
            .args(meter_args)
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            // A test that counts what a bucket admits needs the store's answer: 3 ms is meant for
            // a store that answers in 1 ms, not for a debug gateway and Redis on two loaded
            // cores, where a timed-out check goes to the limit's failure policy (fail open
            // admits). A flag or the test's own environment still wins.
            .env("TOLLGATE_STORE_TIMEOUT", "1s")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn tollgate");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let mut addr = None;
        let mut admin = None;
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        for line in lines.by_ref() {
            let line = line.unwrap_or_default();
            seen.lock().unwrap().push(line.clone());
            // With --log-format json the startup lines are events with the address as a field.
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                let a = v["addr"].as_str().and_then(|a| a.parse::<SocketAddr>().ok());
                match v["message"].as_str() {
                    Some("tollgate listening") => addr = a,
                    Some("admin listening") => admin = a,
                    _ => {}
                }
            } else if let Some(rest) = line.split("listening on http").nth(1) {
                let a = rest.trim_start_matches('s').trim_start_matches("://");
                let a = a.split_whitespace().next().unwrap_or("");
                let a: SocketAddr = a.parse().unwrap_or_else(|_| panic!("bad address in {line:?}"));
                if line.starts_with("admin") {
                    admin = Some(a);
                } else {
                    addr = Some(a);
                }
            }
            if addr.is_some() && admin.is_some() {
                break;
            }
        }
        // Keep draining stdout so the process never blocks on a full pipe.
        let keep = seen.clone();
        let drain = std::thread::spawn(move || {
            for line in lines {
                keep.lock().unwrap().push(line.unwrap_or_default());
            }
        });
        let Some(addr) = addr else {
            let _ = child.kill();
            let err = std::fs::read_to_string(&stderr_path).unwrap_or_default();
            panic!("tollgate did not start: {err}");
        };
        Tollgate {
            child,
            addr,
            admin,
            stderr_path,
            stdout: seen,
            drain: Some(drain),
            _dir: dir,
        }
    }

    /// Stops the process with SIGTERM and returns everything it printed on stdout and stderr.
    pub fn stop(&mut self) -> (String, String) {
        self.signal("TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "tollgate still runs 30 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(d) = self.drain.take() {
            d.join().unwrap();
        }
        (self.stdout.lock().unwrap().join("\n"), self.stderr())
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin.expect("admin listener"), path)
    }

    /// Stderr once `seen` holds for it, for up to 10 s: access lines are written by a thread
    /// of their own, a moment after their request is answered. Returns it either way.
    pub async fn stderr_when(&self, seen: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.stderr();
            if seen(&log) || Instant::now() > deadline {
                return log;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Sends a signal with `kill`.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill -{sig} failed");
    }

    /// Peak resident memory of the process in KiB (VmHWM).
    pub fn peak_rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Tollgate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `tollgate demo-upstream` process with a pool of workers; killed on drop.
pub struct DemoUpstreamProc {
    pub child: Child,
    pub addr: SocketAddr,
}

impl DemoUpstreamProc {
    /// `tollgate demo-upstream --workers <workers> --latency-ms <latency_ms>` on a free port.
    pub fn spawn(workers: u32, latency_ms: u64) -> DemoUpstreamProc {
        DemoUpstreamProc::spawn_with(&[
            "--listen",
            "127.0.0.1:0",
            "--workers",
            &workers.to_string(),
            "--latency-ms",
            &latency_ms.to_string(),
        ])
    }

    /// `tollgate demo-upstream <args>`, once it says where it listens.
    pub fn spawn_with(args: &[&str]) -> DemoUpstreamProc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("demo-upstream")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn tollgate demo-upstream");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let addr = lines.by_ref().find_map(|l| {
            let l = l.ok()?;
            l.strip_prefix("demo upstream listening on http://")?
                .trim()
                .parse()
                .ok()
        });
        std::thread::spawn(move || for _ in lines {});
        let Some(addr) = addr else {
            let _ = child.kill();
            panic!("tollgate demo-upstream did not start");
        };
        DemoUpstreamProc { child, addr }
    }
}

impl Drop for DemoUpstreamProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Resident memory of process `pid` in KiB (`VmRSS`), 0 once it is gone.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// CPU seconds (user + system) process `pid` has used, from /proc; 0 once it is gone.
pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    // utime and stime, in USER_HZ (100 on Linux).
    (f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0)) / 100.0
}
