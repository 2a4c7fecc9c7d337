//! The world `tollgate meter` runs in for its tests, with the test playing the gateways: the
//! rules, usage records written into the Redis stream or the embedded store's metering file,
//! the meter run as a process on either, and its `/metrics` read while it runs.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{RedisServer, require_binary};
use tollgate_meter::flags::Flag;
use tollgate_meter::record::{Identity, Kind, Record};

/// Keys with a daily quota in Paris, a monthly one in New York, none (UTC), and a small one.
pub const RULES: &str = r#"{
  "version": 1,
  "upstreams": { "u": { "url": "http://127.0.0.1:1" } },
  "limits": { "plan": { "dimension": "key" } },
  "keys": [
    { "id": "k-paris", "tenant": "grocer",
      "sha256": "1670f2e42fefa5044d59a65349e47c566009488fc57d7b4376dd5787b59e3c57",
      "limits": { "plan": { "rate": "10/1s", "burst": 20 } },
      "quota": { "per": "day", "limit": 100, "timezone": "Europe/Paris" } },
    { "id": "k-month", "tenant": "acme",
      "sha256": "a5c7d1719e284f2c9485405d44f62d152cde9e6ede83e1a79a2442b65f6a8735",
      "limits": { "plan": { "rate": "10/1s", "burst": 20 } },
      "quota": { "per": "month", "limit": 1000, "timezone": "America/New_York" } },
    { "id": "k-plain", "tenant": "plain, inc",
      "sha256": "a116c9ed46d6207734a43317d30fd88f52ac8634c37d904bbf4e41d865f90475",
      "limits": { "plan": { "rate": "10/1s", "burst": 20 } } },
    { "id": "k-small", "tenant": "small",
      "sha256": "5fb6a47e368e12e5d8b19280796e6a3d146fe391ed2e967d5f95c55bfb0f9c2f",
      "limits": { "plan": { "rate": "10/1s", "burst": 20 } },
      "quota": { "per": "day", "limit": 10, "timezone": "Europe/Paris" } }
  ],
  "routes": [ { "name": "r", "method": "*", "path": "/", "upstream": "u", "cost": { "plan": 1 } } ]
}"#;

/// 2025-11-30T22:30:00Z: 23:30 on 30 November in Paris.
pub const BEFORE_MIDNIGHT: i64 = 1_764_541_800_000;
/// 2025-11-30T23:30:00Z: 00:30 on 1 December in Paris (a new day and a new month there), still
/// 30 November in UTC and in New York.
pub const AFTER_MIDNIGHT: i64 = 1_764_545_400_000;

pub fn id(gateway: &str, boot: &str) -> Identity {
    Identity {
        gateway: gateway.into(),
        boot: boot.into(),
    }
}

pub fn usage(who: &Identity, seq: u64, key: &str, total: u64) -> Record {
    Record {
        identity: who.clone(),
        seq,
        kind: Kind::Usage {
            key: key.into(),
            total,
        },
    }
}

pub fn end(who: &Identity, seq: u64) -> Record {
    Record {
        identity: who.clone(),
        seq,
        kind: Kind::End,
    }
}

/// Where the gateways write and the meter reads: the Redis stream, or the metering file.
pub enum Place {
    Redis { server: RedisServer, next: u64 },
    File { path: PathBuf },
}

pub struct World {
    pub place: Place,
    pub dir: tempfile::TempDir,
    pub rules: PathBuf,
}

impl World {
    pub fn redis() -> World {
        World::new(Place::Redis {
            server: RedisServer::start(),
            next: 0,
        })
    }

    pub fn file() -> World {
        World::new(Place::File { path: PathBuf::new() })
    }

    pub fn new(mut place: Place) -> World {
        let dir = tempfile::tempdir().unwrap();
        let rules = dir.path().join("rules.json");
        std::fs::write(&rules, RULES).unwrap();
        if let Place::File { path } = &mut place {
            *path = dir.path().join("usage.db");
        }
        World { place, dir, rules }
    }

    pub fn redis_server(&self) -> &RedisServer {
        match &self.place {
            Place::Redis { server, .. } => server,
            Place::File { .. } => panic!("not on Redis"),
        }
    }

    /// `--store URL` or `--meter-file PATH`, and `--rules PATH`.
    pub fn source(&self) -> Vec<String> {
        let mut a = match &self.place {
            Place::Redis { server, .. } => vec!["--store".to_string(), server.url()],
            Place::File { path } => vec!["--meter-file".to_string(), path.display().to_string()],
        };
        a.extend(["--rules".to_string(), self.rules.display().to_string()]);
        a
    }

    /// Appends records as gateways do, each stamped `at_ms`: the stream entry id's time, or
    /// the row's `at_ms`. Times must not go back (stream ids only grow).
    pub fn write(&mut self, at_ms: i64, records: &[Record]) {
        match &mut self.place {
            Place::Redis { server, next } => {
                let mut lines = String::new();
                for r in records {
                    *next += 1;
                    lines.push_str(&format!("XADD tollgate:usage {at_ms}-{next}"));
                    for (name, value) in r.fields() {
                        lines.push_str(&format!(" {name} {value}"));
                    }
                    lines.push('\n');
                }
                let out = redis_pipe(server, &lines);
                for (line, reply) in lines.lines().zip(out.lines()) {
                    assert!(reply.contains(&format!("{at_ms}-")), "{line} answered {reply:?}");
                }
            }
            Place::File { path } => {
                let mut conn = tollgate_meter::sqlite::open(path).unwrap();
                tollgate_meter::sqlite::append(&mut conn, at_ms, records).unwrap();
            }
        }
    }

    pub fn meter(&self, args: &[&str]) -> Output {
        meter_command(self, args).output().expect("tollgate runs")
    }

    /// `tollgate meter --once`, which must succeed; returns its log.
    pub fn once(&self, extra: &[&str]) -> String {
        let mut args = vec!["--once"];
        args.extend(extra);
        let out = self.meter(&args);
        let log = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "meter --once failed: {log}");
        log
    }

    /// `tollgate meter usage --key KEY PERIOD…` as JSON.
    pub fn usage(&self, key: &str, period: &[&str]) -> serde_json::Value {
        let mut args = vec!["usage", "--key", key];
        args.extend(period);
        let out = self.meter(&args);
        assert!(
            out.status.success(),
            "usage {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "usage printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// (admitted, unclean_ends) of a key in a period.
    pub fn admitted(&self, key: &str, period: &[&str]) -> (u64, u64) {
        let v = self.usage(key, period);
        (
            v["admitted"].as_u64().unwrap(),
            v["unclean_ends"].as_u64().unwrap(),
        )
    }

    pub fn flag(&self, key: &str) -> Option<Flag> {
        let json = match &self.place {
            Place::Redis { server, .. } => {
                let v = server.cli(&["HGET", tollgate_meter::flags::FLAGS, key]);
                (!v.is_empty()).then_some(v)
            }
            Place::File { path } => {
                let conn = tollgate_meter::sqlite::open(path).unwrap();
                tollgate_meter::sqlite::read_flags(&conn)
                    .unwrap()
                    .into_iter()
                    .find(|(k, _)| k == key)
                    .map(|(_, j)| j)
            }
        }?;
        Some(serde_json::from_str(&json).unwrap_or_else(|e| panic!("flag of {key}: {e}: {json}")))
    }

    pub fn set_flag(&self, key: &str, flag: &Flag) {
        match &self.place {
            Place::Redis { server, .. } => {
                let json = serde_json::to_string(flag).unwrap();
                server.cli(&["HSET", tollgate_meter::flags::FLAGS, key, &json]);
            }
            Place::File { path } => {
                let conn = tollgate_meter::sqlite::open(path).unwrap();
                tollgate_meter::sqlite::write_flag(&conn, key, flag).unwrap();
            }
        }
    }
}

pub fn meter_command(w: &World, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    // A subcommand's name comes first, then the place and the rules.
    let (sub, rest) = match args.first() {
        Some(&s) if s == "usage" || s == "export" => (Some(s), &args[1..]),
        _ => (None, args),
    };
    cmd.arg("meter");
    if let Some(s) = sub {
        cmd.arg(s);
    }
    cmd.args(w.source())
        .args(rest)
        .env("TOLLGATE_LOG", "info")
        .stdin(Stdio::null());
    cmd
}

/// Sends commands to redis-cli on its standard input, one a line; returns its replies.
pub fn redis_pipe(server: &RedisServer, lines: &str) -> String {
    let mut child = Command::new(require_binary("redis-cli"))
        .args(["-p", &server.port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("redis-cli runs");
    child.stdin.take().unwrap().write_all(lines.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Runs the consumer with a metrics listener, waits until `/metrics` shows `want`, stops it
/// and returns (metrics text, log).
pub fn run_until_metrics(w: &World, extra: &[&str], want: &str) -> (String, String) {
    run_until(w, extra, want, |text| text.contains(want))
}

/// The value of a sample in a `/metrics` text.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// As [`run_until_metrics`], until `ok` holds of the text.
pub fn run_until(w: &World, extra: &[&str], want: &str, ok: impl Fn(&str) -> bool) -> (String, String) {
    let mut args = vec!["--metrics-listen", "127.0.0.1:0", "--poll", "100ms"];
    args.extend(extra);
    let mut child: Child = meter_command(w, &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("meter metrics on http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .unwrap_or_else(|| {
            let _ = child.kill();
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            panic!("no metrics address printed: {line:?}; log: {err}")
        })
        .to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut text = String::new();
    while Instant::now() < deadline {
        text = scrape(&addr);
        if ok(&text) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(ok(&text), "/metrics never showed {want}:\n{text}\nlog:\n{log}");
    (text, log)
}

/// GET /metrics over a plain socket.
pub fn scrape(addr: &str) -> String {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    let _ =
        s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes());
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
}

/// Two gateways, each with a running total for k-paris on both sides of Paris midnight and
/// one for k-plain, both ending cleanly.
pub fn two_gateways_across_midnight(w: &mut World) {
    let (a, b) = (id("gw-a", "a1"), id("gw-b", "b1"));
    w.write(BEFORE_MIDNIGHT, &[usage(&a, 1, "k-paris", 30)]);
    w.write(BEFORE_MIDNIGHT + 1, &[usage(&b, 1, "k-paris", 7)]);
    w.write(
        AFTER_MIDNIGHT,
        &[usage(&a, 2, "k-paris", 50), usage(&a, 3, "k-plain", 5)],
    );
    w.write(AFTER_MIDNIGHT + 1, &[usage(&b, 2, "k-paris", 20)]);
    w.write(AFTER_MIDNIGHT + 2, &[end(&a, 4), end(&b, 3)]);
}
