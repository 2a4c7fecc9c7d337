//! Redis store figures, measured in one run against a `redis-server` this program starts on a
//! free loopback port: checks per second through `RedisStore` from many tasks against
//! `redis-benchmark` running EVALSHA of the same script with the same ARGV at `-P 16`, the
//! latency of one check, and Redis memory per bucket key over 1,000,000 keys.
//!
//! Run: `cargo bench --bench redis_store` (options after `--`: `--rounds 3 --seconds 5
//! --tasks 128 --keys 10000 --memory-keys 1000000 --workers 0 --connections 0`; `--only-store`
//! for the store's rounds alone, `--only-memory` for the memory alone). Under `cargo test
//! --all-targets` it only says how to run it.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate_limit::bucket::{BucketParams, Charge, Rate};
use tollgate_store::redis::{RedisStore, Target};
use tollgate_store::{CheckItem, FailurePolicy, Store};

struct Opts {
    rounds: usize,
    seconds: u64,
    tasks: usize,
    keys: usize,
    memory_keys: usize,
    /// Tokio worker threads; 0 is the runtime's default (one per core), as in `tollgate serve`.
    workers: usize,
    /// Connections per node in RedisStore; 0 is its default.
    connections: usize,
    /// Only the RedisStore throughput rounds (for profiling the client).
    only_store: bool,
    /// Only the memory per bucket (no throughput or latency rounds).
    only_memory: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        rounds: 3,
        seconds: 5,
        tasks: 128,
        keys: 10_000,
        memory_keys: 1_000_000,
        workers: 0,
        connections: 0,
        only_store: false,
        only_memory: false,
    };
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < args.len() {
        let value = || -> usize {
            args.get(i + 1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{} needs a whole number", args[i]))
        };
        match args[i].as_str() {
            "--rounds" => o.rounds = value(),
            "--seconds" => o.seconds = value() as u64,
            "--tasks" => o.tasks = value(),
            "--keys" => o.keys = value(),
            "--memory-keys" => o.memory_keys = value(),
            "--workers" => o.workers = value(),
            "--connections" => o.connections = value(),
            "--only-store" => {
                o.only_store = true;
                i += 1;
                continue;
            }
            "--only-memory" => {
                o.only_memory = true;
                i += 1;
                continue;
            }
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    o
}

struct Server {
    port: u16,
    child: Child,
    _dir: std::path::PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

fn free_port() -> u16 {
    tollgate_testkit::free_port().expect("a free loopback port")
}

fn start_redis() -> Server {
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("tollgate-bench-redis-{port}"));
    std::fs::create_dir_all(&dir).unwrap();
    let child = Command::new("redis-server")
        .args(tollgate_testkit::redis_server_args(port, &dir))
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("redis-server is needed for this benchmark: {e}"));
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "redis-server did not start on port {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Server {
        port,
        child,
        _dir: dir,
    }
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn used_memory(port: u16) -> u64 {
    let info = cli(port, &["INFO", "memory"]);
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no used_memory in INFO memory: {info}"))
}

/// The demo's k-7 rule: 600/60s, burst 20 (scale 100,000, refill 1, capacity 2,000,000).
fn k7() -> BucketParams {
    BucketParams::new(Rate::parse("600/60s").unwrap(), 20).unwrap()
}

fn item(key: String, params: BucketParams) -> CheckItem {
    CheckItem::new(
        key.into(),
        Charge {
            params,
            cost: 1,
            shadow: false,
        },
        0,
        FailurePolicy::Local,
    )
}

/// redis-benchmark's `__rand_int__` is 12 digits; the store run uses the same names.
fn bench_key(i: usize) -> String {
    format!("rl:{{t{i:012}}}:plan")
}

/// redis-benchmark, EVALSHA of lua/check.lua with the ARGV RedisStore sends for k-7: the
/// ceiling for one node on this machine. Returns checks per second.
fn redis_benchmark(port: u16, sha: &str, keys: usize, n: u64) -> (f64, String) {
    let (rps, _, _, command) = redis_benchmark_with(port, sha, keys, n, 50, 16);
    (rps, command)
}

/// redis-benchmark with `clients` connections and `-P pipeline`: (checks/s, p50 ms, p99 ms,
/// command).
fn redis_benchmark_with(
    port: u16,
    sha: &str,
    keys: usize,
    n: u64,
    clients: u32,
    pipeline: u32,
) -> (f64, f64, f64, String) {
    let p = k7();
    // The clock (-1: TIME), one request, of one bucket, then the bucket's seven numbers.
    let argv = [
        "-1".to_string(),
        "1".to_string(),
        "1".to_string(),
        p.scale.to_string(),
        p.refill.to_string(),
        p.capacity.to_string(),
        p.units(1).to_string(),
        p.ttl_ms().to_string(),
        "0".to_string(),
        "0".to_string(),
    ];
    let mut args: Vec<String> = [
        "-p",
        &port.to_string(),
        "-c",
        &clients.to_string(),
        "-P",
        &pipeline.to_string(),
        "-n",
        &n.to_string(),
        "-r",
        &keys.to_string(),
        "--csv",
        "EVALSHA",
        sha,
        "2",
        // redis-benchmark draws every `__rand_int__` on its own and can't compute `page_of`, so
        // the random part is the page and the bucket's name is fixed: one field in each of
        // `keys` pages, as the store's 10,000 buckets mostly are over 16,384 pages. One node
        // doesn't care which slot a key hashes to.
        "rl:{t}:plan",
        "rl:page:{__rand_int__}",
    ]
    .map(String::from)
    .to_vec();
    args.extend(argv);
    let command = format!("redis-benchmark {}", args.join(" "));
    let out = Command::new("redis-benchmark")
        .args(&args)
        .stderr(Stdio::null())
        .output()
        .expect("redis-benchmark is needed for this benchmark");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with("\"EVALSHA"))
        .unwrap_or_else(|| panic!("no result from redis-benchmark: {text}"));
    // "test","rps","avg","min","p50","p95","p99","max"; the test name has no commas.
    let fields: Vec<f64> = line
        .split(',')
        .skip(1)
        .map(|f| f.trim_matches('"').parse().unwrap())
        .collect();
    (fields[0], fields[3], fields[5], command)
}

/// Checks per second through RedisStore from `tasks` tasks for `seconds`.
async fn store_throughput(
    store: Arc<RedisStore>,
    items: Arc<Vec<CheckItem>>,
    tasks: usize,
    seconds: u64,
) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for t in 0..tasks {
        let (store, items, stop, count) = (store.clone(), items.clone(), stop.clone(), count.clone());
        handles.push(tokio::spawn(async move {
            let mut x = (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut done = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let it = &items[(x % items.len() as u64) as usize];
                store.check(std::slice::from_ref(it)).await.expect("check");
                done += 1;
            }
            count.fetch_add(done, Ordering::Relaxed);
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.await.unwrap();
    }
    count.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// Redis's own time inside EVALSHA per call since the last CONFIG RESETSTAT (INFO commandstats).
fn evalsha_usec_per_call(port: u16) -> f64 {
    let stats = cli(port, &["INFO", "commandstats"]);
    stats
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("usec_per_call=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// CPU seconds of a process from /proc: (own user + system, waited-for children's).
fn cpu_secs(pid: &str) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    // USER_HZ is 100 on Linux.
    let tick = |i: usize| f.get(i).copied().unwrap_or(0.0) / 100.0;
    (tick(11) + tick(12), tick(13) + tick(14))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn micros(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

/// Builds `n` keys of one encoding inside Redis, in chunks, to price encodings against each
/// other. Returns bytes per key from INFO memory.
fn price_encoding(port: u16, kind: &str, n: usize) -> f64 {
    const BUILD: &str = r#"
local start, n, kind = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
for i = start, start + n - 1 do
  local k = 'rl:{k' .. i .. '}:plan'
  if kind == 'hash-of-two-floats' then
    redis.call('HSET', k, 'tokens', '19.999987', 'ts', '1796046854.702427')
    redis.call('PEXPIRE', k, 6001000)
  elseif kind == 'packed-18-bytes' then
    redis.call('SET', k, struct.pack('<I7I7I4', 9900000000, 1796046854702427, 60000000), 'PX', 6001000)
  elseif kind == 'integer' then
    redis.call('SET', k, '1796046854702427', 'PX', 6001000)
  end
end
return n
"#;
    assert_eq!(cli(port, &["FLUSHALL", "SYNC"]), "OK");
    let before = used_memory(port);
    let chunk = 50_000;
    let mut start = 0;
    while start < n {
        let m = chunk.min(n - start);
        cli(
            port,
            &["EVAL", BUILD, "0", &start.to_string(), &m.to_string(), kind],
        );
        start += m;
    }
    assert_eq!(cli(port, &["DBSIZE"]), n.to_string(), "{kind}");
    let after = used_memory(port);
    (after - before) as f64 / n as f64
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("redis_store: a benchmark, not a test; run `cargo bench --bench redis_store`");
        return;
    }
    let o = opts();
    let server = start_redis();
    let port = server.port;
    let url = format!("redis://127.0.0.1:{port}");
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if o.workers > 0 {
        builder.worker_threads(o.workers);
    }
    let rt = builder.enable_all().build().unwrap();
    println!("{}", tollgate_testkit::machine_line());
    println!(
        "redis: {}",
        cli(port, &["INFO", "server"])
            .lines()
            .find(|l| l.starts_with("redis_version"))
            .unwrap_or("")
    );

    let connections = if o.connections == 0 {
        tollgate_store::redis::DEFAULT_CONNECTIONS
    } else {
        o.connections
    };
    println!("RedisStore: {connections} connection(s)");
    let store = Arc::new(
        rt.block_on(RedisStore::connect_with(Target::node(&url), None, connections))
            .expect("connect"),
    );
    if o.only_memory {
        memory(&o, &rt, &store, port);
        return;
    }
    let sha = store.script_sha().to_string();
    let items: Arc<Vec<CheckItem>> = Arc::new((0..o.keys).map(|i| item(bench_key(i), k7())).collect());

    // Throughput: alternate the ceiling and the store, same key space, same ARGV.
    println!(
        "\n## Throughput: {} keys, rule 600/60s burst 20, {} s per store round",
        o.keys, o.seconds
    );
    let mut ratios = Vec::new();
    let mut command = String::new();
    let server_pid = server.child.id().to_string();
    for round in 1..=o.rounds {
        let n = 80_000 * o.seconds;
        if o.only_store {
            let (calls0, checks0) = store.calls_and_checks();
            let ours = rt.block_on(store_throughput(store.clone(), items.clone(), o.tasks, o.seconds));
            let (calls1, checks1) = store.calls_and_checks();
            let per_call = (checks1 - checks0) as f64 / (calls1 - calls0).max(1) as f64;
            println!(
                "round {round}: RedisStore, {} tasks: {ours:.0}/s, {per_call:.1} checks per call",
                o.tasks
            );
            continue;
        }
        let (s0, c0) = (cpu_secs(&server_pid).0, cpu_secs("self").1);
        cli(port, &["CONFIG", "RESETSTAT"]);
        let (ceiling, cmd) = redis_benchmark(port, &sha, o.keys, n);
        let script_ceiling = evalsha_usec_per_call(port);
        cli(port, &["CONFIG", "RESETSTAT"]);
        let (s1, c1) = (cpu_secs(&server_pid).0, cpu_secs("self").1);
        command = cmd;
        let own0 = cpu_secs("self").0;
        let (calls0, checks0) = store.calls_and_checks();
        let t = Instant::now();
        let ours = rt.block_on(store_throughput(store.clone(), items.clone(), o.tasks, o.seconds));
        let checks = ours * t.elapsed().as_secs_f64();
        let (s2, own1) = (cpu_secs(&server_pid).0, cpu_secs("self").0);
        let (calls1, checks1) = store.calls_and_checks();
        let per_call = (checks1 - checks0) as f64 / (calls1 - calls0).max(1) as f64;
        let script_ours = evalsha_usec_per_call(port);
        ratios.push(ours / ceiling);
        println!(
            "round {round}: redis-benchmark EVALSHA -P 16: {ceiling:.0}/s (CPU per check: server {:.1} µs, client {:.1} µs; \
             script {script_ceiling:.1} µs per call); RedisStore, {} tasks: {ours:.0}/s (server {:.1} µs, client {:.1} µs; \
             {per_call:.1} checks per call, script {script_ours:.1} µs per call); ratio {:.2}",
            (s1 - s0) * 1e6 / n as f64,
            (c1 - c0) * 1e6 / n as f64,
            o.tasks,
            (s2 - s1) * 1e6 / checks,
            (own1 - own0) * 1e6 / checks,
            ours / ceiling
        );
    }
    if o.only_store {
        return;
    }
    ratios.sort_by(f64::total_cmp);
    println!("median ratio {:.2} (goal >= 0.8)", ratios[ratios.len() / 2]);
    println!("ceiling command: {command}");

    // Latency of one check, one at a time.
    println!("\n## Latency of one check (one task, sequential)");
    let lat = rt.block_on(async {
        let item = [item("rl:{lat}:plan".into(), k7())];
        for _ in 0..2_000 {
            store.check(&item).await.unwrap();
        }
        let mut lat = Vec::with_capacity(20_000);
        for _ in 0..20_000 {
            let t = Instant::now();
            store.check(&item).await.unwrap();
            lat.push(t.elapsed());
        }
        lat.sort();
        lat
    });
    let (_, b50, b99, bcmd) = redis_benchmark_with(port, &sha, 1, 20_000, 1, 1);
    println!(
        "same machine, same moment, redis-benchmark with one client and no pipeline: p50 {:.0} µs  p99 {:.0} µs\n  ({bcmd})",
        b50 * 1e3,
        b99 * 1e3
    );
    println!(
        "RedisStore: p50 {}  p90 {}  p99 {}  p99.9 {}  max {} over {} checks (goal p99 < 1 ms)",
        micros(percentile(&lat, 0.50)),
        micros(percentile(&lat, 0.90)),
        micros(percentile(&lat, 0.99)),
        micros(percentile(&lat, 0.999)),
        micros(*lat.last().unwrap()),
        lat.len()
    );

    memory(&o, &rt, &store, port);
    drop(server);
}

/// Buckets the store holds under `rl:`, whatever their layout: a string is one bucket, a hash
/// holds one per field.
fn bucket_count(port: u16) -> u64 {
    const COUNT: &str = r#"
local n, cursor = 0, '0'
repeat
  local page = redis.call('SCAN', cursor, 'MATCH', 'rl:*', 'COUNT', 1000)
  cursor = page[1]
  for _, k in ipairs(page[2]) do
    if redis.call('TYPE', k).ok == 'hash' then
      n = n + redis.call('HLEN', k)
    else
      n = n + 1
    end
  end
until cursor == '0'
return n
"#;
    let n = cli(port, &["EVAL", COUNT, "0"]);
    n.parse().unwrap_or_else(|_| panic!("bucket count: {n}"))
}

/// Redis memory per bucket over `memory_keys` buckets, each written by one check through the
/// store, then the same count of keys of other encodings built inside Redis.
fn memory(o: &Opts, rt: &tokio::runtime::Runtime, store: &Arc<RedisStore>, port: u16) {
    println!(
        "\n## Memory per bucket key over {} keys (INFO memory used_memory)",
        o.memory_keys
    );
    assert_eq!(cli(port, &["FLUSHALL", "SYNC"]), "OK");
    let before = used_memory(port);
    // One token a minute, burst 100: a TTL of 100 minutes, so nothing expires while measuring.
    let long = BucketParams::new(Rate::parse("1/60s").unwrap(), 100).unwrap();
    rt.block_on(async {
        let next = Arc::new(AtomicU64::new(0));
        let mut handles = Vec::new();
        for _ in 0..64 {
            let (store, next) = (store.clone(), next.clone());
            let total = o.memory_keys as u64;
            handles.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let it = item(format!("rl:{{k{i}}}:plan"), long);
                    store.check(std::slice::from_ref(&it)).await.expect("check");
                }
            }));
        }
        for h in handles {
            h.await.unwrap();
        }
    });
    let after = used_memory(port);
    assert_eq!(bucket_count(port), o.memory_keys as u64);
    let sample = format!("rl:{{k{}}}:plan", o.memory_keys - 1);
    println!(
        "RedisStore (names like {sample}): {:.1} bytes per bucket over {} Redis keys",
        (after - before) as f64 / o.memory_keys as f64,
        cli(port, &["DBSIZE"])
    );
    for kind in ["hash-of-two-floats", "packed-18-bytes", "integer"] {
        println!(
            "built in Redis, {kind} + TTL, same names: {:.1} bytes per key",
            price_encoding(port, kind, o.memory_keys)
        );
    }
}
