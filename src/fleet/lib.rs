//! `tollgate fleet`: a fleet of gateways under a retry storm, on one machine. It starts one
//! redis-server, the demo upstream and N `tollgate serve` processes, runs the storm on
//! k7-demo-key with the other partners' traffic beside it once per mode (central, local, shares;
//! or, for a store outage, central once per failure policy with the store stopped mid-storm),
//! reports each side by side, and stops everything it started, on success, on error and on
//! Ctrl-C alike.
//!
//! - [`args`]: the command line, checked into a `Plan`.
//! - [`rules`]: the rules each run serves, and the storm key's contract.
//! - [`load`]: the storm and the partners' traffic; every answer recorded.
//! - [`report`]: the numbers, as a table or JSON.
//! - [`procs`]: the processes a run starts, killed when their handles drop.

pub mod args;
pub mod load;
pub mod procs;
pub mod report;
pub mod rules;

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::time::{Instant, sleep_until};

pub use args::FleetArgs;
use args::{Mode, Plan, Policy, RunSpec};
use load::{LoadSpec, Target};
use procs::{GatewayProc, GatewaySpec, Proc, Redis, WorkDir};
use report::{RunFacts, RunReport, StoreCounters};
use rules::{BaseRules, Contract};

/// How long a stopped process may take to exit before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(3);

#[derive(Debug, Serialize)]
struct Settings {
    gateways: u32,
    duration_s: f64,
    workers: u32,
    /// `null` when flooding.
    pad_ms: Option<f64>,
    others_rate: u32,
    partner_keys: usize,
    store_timeout_ms: f64,
    gateway_threads: u16,
    rules: String,
    store: String,
    outage_s: Option<f64>,
    /// The tollgate binary's build: the harness and every gateway run this same binary.
    build: &'static str,
    cpus: usize,
}

#[derive(Debug, Serialize)]
struct Output {
    settings: Settings,
    contract: Contract,
    runs: Vec<RunReport>,
}

/// Runs the command; the error names what failed and is meant for the user as it is.
pub fn main(a: &FleetArgs) -> Result<(), String> {
    let plan = Plan::from_args(a)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let out = rt.block_on(async {
        tokio::select! {
            r = run_all(&plan) => r,
            s = interrupted() => Err(format!("{s}: stopped every process it started")),
        }
    });
    // Dropping the runtime cancels the workers and drops every process handle, which kills it.
    drop(rt);
    let out = out?;
    if plan.json {
        let text = serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?;
        println!("{text}");
    } else {
        print!("{}", text_report(&out));
    }
    Ok(())
}

async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return "interrupted";
    };
    tokio::select! {
        _ = term.recv() => "terminated (SIGTERM)",
        _ = tokio::signal::ctrl_c() => "interrupted (SIGINT)",
    }
}

/// Progress goes to stderr, so stdout is the report alone (text or JSON).
fn progress(msg: &str) {
    eprintln!("fleet: {msg}");
}

/// `/proc/loadavg`'s three averages, the machine's load while figures were taken.
pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// The longest any bucket of the rules takes to refill from empty, plus a second: a store
/// bucket left unused this long is full again (and expired), as at the start of a run.
fn refill_time(snap: &tollgate_rules::Snapshot) -> Duration {
    let mut longest = 0f64;
    for (li, limit) in snap.limits.iter().enumerate() {
        let mut all: Vec<_> = limit.numbers.iter().collect();
        all.extend((0..snap.keys.len()).filter_map(|k| snap.keys.own_numbers(k, li)));
        for n in all {
            longest = longest.max(n.params.burst as f64 / n.params.rate.per_second());
        }
    }
    Duration::from_secs_f64(longest.min(3_600.0) + 1.0)
}

async fn start_gateways(
    setup: Arc<GatewaySpec>,
    n: u32,
    dir: &std::path::Path,
) -> Result<Vec<GatewayProc>, String> {
    let mut tasks = Vec::new();
    for i in 0..n as usize {
        let (setup, dir) = (setup.clone(), dir.to_path_buf());
        tasks.push(tokio::spawn(
            async move { GatewayProc::start(&setup, i, &dir).await },
        ));
    }
    let mut gws = Vec::new();
    let mut first_err = None;
    for t in tasks {
        match t.await {
            Ok(Ok(g)) => gws.push(g),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(format!("a gateway start task failed: {e}"));
            }
        }
    }
    if let Some(e) = first_err {
        stop_all(gws.into_iter().map(|g| g.proc).collect()).await;
        return Err(e);
    }
    for g in &gws {
        if let Err(e) = g.wait_ready().await {
            stop_all(gws.into_iter().map(|g| g.proc).collect()).await;
            return Err(e);
        }
    }
    Ok(gws)
}

async fn stop_all(procs: Vec<Proc>) {
    let tasks: Vec<_> = procs
        .into_iter()
        .map(|p| tokio::spawn(p.stop(STOP_GRACE)))
        .collect();
    for t in tasks {
        let _ = t.await;
    }
}

async fn run_all(plan: &Plan) -> Result<Output, String> {
    let base = BaseRules::load(plan.rules.as_deref())?;
    let snap = base.compiled()?;
    let contract = rules::contract(&snap, &plan.storm_key)?;
    let storm_id = snap.keys[rules::key_index(&snap, &plan.storm_key, "--storm-key")?]
        .id
        .to_string();
    if let Some(d) = &plan.trace_dir {
        std::fs::create_dir_all(d).map_err(|e| format!("--trace-dir {}: {e}", d.display()))?;
    }
    for k in &plan.partner_keys {
        rules::key_index(&snap, k, "--partner-keys")?;
    }
    let refill = refill_time(&snap);
    let bin = std::env::current_exe().map_err(|e| format!("cannot find the tollgate binary: {e}"))?;
    let dir = WorkDir::new(plan.log_dir.as_deref())?;

    let redis = if plan.needs_store() && plan.redis_url.is_none() {
        progress("starting redis-server");
        Some(Redis::start(&dir.path).await?)
    } else {
        None
    };
    let store_url = plan.redis_url.clone().or_else(|| redis.as_ref().map(Redis::url));
    let (upstream, upstream_addr) = procs::start_upstream(&bin, &dir.path).await?;
    let settings = Settings {
        gateways: plan.gateways,
        duration_s: plan.duration.as_secs_f64(),
        workers: plan.workers,
        pad_ms: plan.pad.map(|p| p.as_secs_f64() * 1e3),
        others_rate: plan.others_rate,
        partner_keys: plan.partner_keys.len(),
        store_timeout_ms: plan.store_timeout.as_secs_f64() * 1e3,
        gateway_threads: plan.gateway_threads,
        rules: base.label.clone(),
        store: match (&plan.redis_url, &redis) {
            (Some(u), _) => u.clone(),
            (None, Some(r)) => format!("redis-server started on 127.0.0.1:{}", r.port),
            (None, None) => "none (no central run)".into(),
        },
        outage_s: plan.outage.map(|d| d.as_secs_f64()),
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };

    let mut runs = Vec::new();
    let mut store_used_at: Option<Instant> = None;
    for &run in &plan.runs {
        let fleet = Fleet {
            base: &base,
            contract: &contract,
            storm_id: &storm_id,
            bin: &bin,
            dir: &dir,
            store_url: store_url.as_deref(),
            redis: redis.as_ref(),
            upstream: upstream_addr,
        };
        let report = one_run(plan, run, &fleet, store_used_at.map(|t| t + refill)).await?;
        if run.mode == Mode::Central {
            store_used_at = Some(Instant::now());
        }
        progress(&format!(
            "{}: storm {} admitted of {} (contract {:.0}), offered {:.1}/s; others {} errors",
            report.run,
            report.storm.admitted,
            report.storm.requests,
            report.storm.contract_bound,
            report.storm.offered_per_s,
            report.others.errors
        ));
        runs.push(report);
    }
    upstream.stop(STOP_GRACE).await;
    if let Some(r) = redis {
        r.proc.stop(STOP_GRACE).await;
    }
    drop(dir);
    Ok(Output {
        settings,
        contract,
        runs,
    })
}

/// What every run of one invocation shares.
struct Fleet<'a> {
    base: &'a BaseRules,
    contract: &'a Contract,
    /// The storm key's public id (`k-7`), for the trace files.
    storm_id: &'a str,
    bin: &'a std::path::Path,
    dir: &'a WorkDir,
    store_url: Option<&'a str>,
    redis: Option<&'a Redis>,
    upstream: std::net::SocketAddr,
}

/// Writes the storm's requests as a `tollgate replay` trace: time (send time, seconds from the
/// start of the run), key id, gateway.
fn write_trace(path: &std::path::Path, storm_id: &str, answers: &[load::Answer]) -> Result<(), String> {
    use std::io::Write;
    let mut rows: Vec<&load::Answer> = answers.iter().filter(|r| r.who == load::STORM).collect();
    rows.sort_by_key(|r| r.send_us);
    let file = std::fs::File::create(path).map_err(|e| format!("--trace-dir: {}: {e}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    let write = || -> std::io::Result<()> {
        writeln!(w, "time,key,gateway")?;
        for r in rows {
            writeln!(
                w,
                "{}.{:06},{storm_id},{}",
                r.send_us / 1_000_000,
                r.send_us % 1_000_000,
                r.gateway
            )?;
        }
        w.flush()
    };
    write().map_err(|e| format!("--trace-dir: {}: {e}", path.display()))
}

async fn one_run(
    plan: &Plan,
    run: RunSpec,
    fleet: &Fleet<'_>,
    store_full_at: Option<Instant>,
) -> Result<RunReport, String> {
    let label = run.label();
    let store = match run.mode {
        Mode::Central => fleet
            .store_url
            .ok_or("the central mode needs a store, and none was started")?
            .to_string(),
        Mode::Local | Mode::Shares => "memory".to_string(),
    };
    let rules = fleet.base.variant(fleet.upstream, run, plan.gateways)?;
    progress(&format!(
        "{label}: starting {} gateways on {store}",
        plan.gateways
    ));
    let setup = Arc::new(GatewaySpec {
        run: label.clone(),
        bin: fleet.bin.to_path_buf(),
        rules: write_rules(&fleet.dir.path, &label, rules)?,
        store,
        fleet_size: plan.gateways,
        store_timeout: plan.store_timeout,
        threads: plan.gateway_threads,
        log: plan.gateway_log.clone(),
    });
    let gws = start_gateways(setup, plan.gateways, &fleet.dir.path).await?;
    if run.mode == Mode::Central
        && let Some(t) = store_full_at
    {
        // The last run drained the shared buckets; start this one from full, as the first.
        sleep_until(t).await;
    }
    let targets = targets(&gws)?;
    let traffic = LoadSpec {
        duration: plan.duration,
        workers: plan.workers,
        pad: plan.pad,
        storm_key: plan.storm_key.clone(),
        partner_keys: plan.partner_keys.clone(),
        others_rate: plan.others_rate,
    };
    progress(&format!(
        "{label}: storm for {} s (load average {})",
        plan.duration.as_secs_f64(),
        load_average()
    ));
    let load_before = load_average();
    let t0 = Instant::now() + Duration::from_millis(50);
    let (outcome, outage) = tokio::join!(
        load::run_load(&traffic, Arc::new(targets), t0),
        pause_store(plan, run.policy, fleet.redis, t0)
    );
    let (outcome, outage_us) = (outcome?, outage?);
    let counters = store_counters(&gws).await?;
    let load_after = load_average();
    stop_all(gws.into_iter().map(|g| g.proc).collect()).await;
    if let Some(d) = &plan.trace_dir {
        write_trace(
            &d.join(format!("{}.csv", label.replace('/', "-"))),
            fleet.storm_id,
            &outcome.answers,
        )?;
    }
    Ok(report::analyse(
        &outcome.answers,
        RunFacts {
            run: label,
            mode: run.mode.name(),
            policy: run.policy.map(|p| p.name()),
            gateways: plan.gateways,
            duration_us: plan.duration.as_micros() as u64,
            target_per_s: plan.target_rate(),
            others_rate: plan.others_rate,
            contract: fleet.contract,
            outage_us,
            load_before,
            load_after,
            store: counters,
            samples: outcome.samples,
        },
    ))
}

/// Writes a run's rules into the work directory, and returns the file's path.
fn write_rules(dir: &std::path::Path, label: &str, text: String) -> Result<std::path::PathBuf, String> {
    let path = dir.join(format!("rules-{}.json", label.replace('/', "-")));
    std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

/// Where the storm's workers send: each gateway's client and the limited path.
fn targets(gws: &[GatewayProc]) -> Result<Vec<Target>, String> {
    gws.iter()
        .map(|g| {
            Ok(Target {
                client: g.client.clone(),
                uri: format!("http://{}{}", g.addr, rules::PATH)
                    .parse()
                    .map_err(|e| format!("{e}"))?,
            })
        })
        .collect()
}

/// For an outage run (one with a failure `policy`), stops the redis-server halfway through the
/// storm (SIGSTOP) and resumes it `--outage` later; returns when that was, in microseconds from
/// `t0`. `None` for other runs.
async fn pause_store(
    plan: &Plan,
    policy: Option<Policy>,
    redis: Option<&Redis>,
    t0: Instant,
) -> Result<Option<(u64, u64)>, String> {
    let (Some(len), Some(_)) = (plan.outage, policy) else {
        return Ok(None);
    };
    let r = redis.ok_or("--outage needs the redis-server this harness starts")?;
    sleep_until(t0 + plan.duration / 2).await;
    r.proc.signal("STOP").await?;
    let stop = Instant::now() - t0;
    sleep_until(Instant::now() + len).await;
    let resumed = r.proc.signal("CONT").await;
    let resume = Instant::now() - t0;
    resumed?;
    Ok(Some((stop.as_micros() as u64, resume.as_micros() as u64)))
}

/// The store counters summed over every gateway's /metrics.
async fn store_counters(gws: &[GatewayProc]) -> Result<StoreCounters, String> {
    let mut counters = StoreCounters::default();
    for g in gws {
        match g.admin_get("/metrics").await {
            Ok((200, text)) => report::scrape(&text, &mut counters),
            Ok((s, _)) => return Err(format!("{}: /metrics answered {s}", g.proc.name)),
            Err(e) => return Err(e),
        }
    }
    Ok(counters)
}

fn text_report(out: &Output) -> String {
    let s = &out.settings;
    let pad = match s.pad_ms {
        Some(p) => format!(
            "padded to {p:.0} ms (offer {:.0}/s)",
            f64::from(s.workers) * 1e3 / p
        ),
        None => "flooding (no padding)".into(),
    };
    let header = format!(
        "tollgate fleet: {} gateways (tollgate serve --threads {}, {} build), {} storm workers {pad}; others {}/s over {} keys; \
         {} s per run\nstore: {}; store timeout {} ms; rules: {}\ncontract: {} {} burst {} (cost {})\n",
        s.gateways,
        s.gateway_threads,
        s.build,
        s.workers,
        s.others_rate,
        s.partner_keys,
        s.duration_s,
        s.store,
        s.store_timeout_ms,
        s.rules,
        out.contract.limit,
        out.contract.rate,
        out.contract.burst,
        out.contract.cost,
    );
    report::text(&header, &out.runs)
}
