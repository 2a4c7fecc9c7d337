//! The `tollgate` command: parses flags, sets up logging, and hands over to the library.

use std::sync::Arc;

use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::path::PathBuf;
use tollgate_gateway::access::{self, AccessLogFormat};
use tollgate_gateway::app::{self, GatewayConfig, RulesSource};

use clap::{Parser, Subcommand};
use tollgate_gateway::config::{DEFAULT_ACCESS_BUFFER, DemoArgs, LogFormat, ServeArgs, host_name};
use tollgate_gateway::server::{self, ServerLimits};

// jemalloc, for what it gives back: see Cargo.toml.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Debug, Parser)]
#[command(
    name = "tollgate",
    version,
    about = "An HTTP gateway that enforces API rate limits as one fleet"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway.
    Serve(ServeArgs),
    /// Run the gateway with the demo rules and a built-in demo upstream.
    Demo(DemoArgs),
    /// Validate a rules file and print a summary; exits non-zero with the error otherwise.
    CheckRules {
        /// The rules file.
        file: PathBuf,
        /// Accepted for older scripts: every rule set runs on Redis Cluster now.
        #[arg(long, hide = true)]
        cluster: bool,
    },
    /// Print the JSON Schema of a rules file (rules/schema.json is its output).
    RulesSchema,
    /// Connect to a store as `serve` would and say in one line what it is (kind, nodes or
    /// primaries, TLS, user, version, whether scripts may read TIME); exits non-zero with the
    /// reason when it can't serve.
    CheckStore {
        #[command(flatten)]
        store: tollgate_gateway::config::StoreArgs,
        /// Whose clock refills buckets, as `serve --clock`: on `store`, scripts must read TIME.
        #[arg(long, env = "TOLLGATE_CLOCK", value_enum, default_value_t = tollgate_gateway::config::ClockSource::Store)]
        clock: tollgate_gateway::config::ClockSource,
    },
    /// Ask a running gateway's admin listener whether it is alive (`GET /healthz`); exits 0
    /// when it answers 200, 1 otherwise. For a container's HEALTHCHECK, where no curl is.
    Healthcheck {
        /// The admin listener; an unspecified address (0.0.0.0, ::) is asked on loopback.
        #[arg(long, env = "TOLLGATE_ADMIN_LISTEN", default_value = "127.0.0.1:9090")]
        admin_listen: SocketAddr,
        /// The path to ask.
        #[arg(long, default_value = "/healthz")]
        path: String,
    },
    /// Run only the built-in demo upstream ("orders").
    DemoUpstream {
        #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8081")]
        listen: SocketAddr,
        /// Serve this many requests at a time and queue the rest without bound, like an
        /// overloaded service (80 for a slow backend: a database gone from 100 to 250 ms a request).
        #[arg(long)]
        workers: Option<u32>,
        /// With --workers: each request's service time (`/v1/slow?ms=N` takes N instead).
        #[arg(long, default_value_t = 100, requires = "workers")]
        latency_ms: u64,
        /// A name its answers carry as `"instance"`, to tell several instances apart.
        #[arg(long)]
        instance: Option<String>,
    },
    /// Replay a trace through the gateway's limiter code on a virtual clock (offline what-if).
    Replay(tollgate_replay::ReplayArgs),
    /// Start redis-server, the demo upstream and N gateways, drive a retry storm through each
    /// design (one shared bucket, a bucket per gateway, shares) or a store outage, report them
    /// side by side, and stop everything.
    Fleet(tollgate_fleet::FleetArgs),
    /// Add up the gateways' usage records into per-key daily and monthly totals, set quota
    /// flags and report unclean ends; `usage` and `export` read the totals.
    Meter(tollgate_meter::cli::MeterArgs),
    /// One limit shared by three Regions: shares, named grants and a lost Region, modelled.
    Regions(RegionsArgs),
    /// Print a bearer token for the demo's JWT route (`GET /v2/orders`), signed with the
    /// demo's private key (certs/demo-jwt-key.pem, public: for the demo only).
    DemoToken {
        /// The subject: the caller's key id.
        #[arg(long)]
        sub: String,
        /// The tenant (`org` claim); the subject when not given.
        #[arg(long)]
        org: Option<String>,
        /// The `plan` claim: `free` or `pro` in the demo rules.
        #[arg(long, default_value = "free")]
        plan: String,
        /// Seconds until the token expires.
        #[arg(long, default_value_t = 3600)]
        exp_seconds: u64,
    },
}

#[derive(Debug, clap::Args)]
pub struct RegionsArgs {
    #[command(subcommand)]
    pub command: RegionsCommand,
}

#[derive(Debug, Subcommand)]
pub enum RegionsCommand {
    /// Run one scenario through the fluid model, in 10 ms steps, and print each whole second
    /// and the figures.
    Simulate {
        /// demand-shift (C's demand rises; room moves by named grants), demand-shift-jump (the
        /// same, every Region jumping to its target), all-at-once (A falls as B and C rise, all
        /// rebalancing together), lost-region-freeze, lost-region-two-signals (B lost; its share
        /// frozen or reclaimed on silence and a failing health check), cut-off-silence or
        /// cut-off-two-signals (B only cut off; reclaimed on silence alone, or not at all).
        #[arg(long)]
        run: tollgate_regions::Run,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// The target of the lines `serve` and `demo` announce themselves with: in json mode they are
/// events on stdout, at any `TOLLGATE_LOG` level, where the default mode prints plain lines.
const STARTUP: &str = "tollgate::startup";

/// Stderr, each write whole under its lock: a buffer of access lines that a slow reader takes
/// in pieces must not let another log line in between two of them.
struct WholeWrites;

impl std::io::Write for WholeWrites {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::stderr().lock().write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// The target of the one line each request ends with (`tollgate_gateway::request`).
const ACCESS: &str = "tollgate::access";

/// Sets up logging. Access lines go through a writer thread of their own (see "Access lines"
/// in the README): a request only hands its line over, and when `access_buffer` lines are
/// already waiting the line is dropped and counted, never waited for. The returned guard
/// writes what is still waiting when it is dropped, at the end of `main`. With
/// `--access-log-format` the access lines have a writer of their own ([`start_access_log`]), which
/// counts the dropped lines instead (`counts_access` false).
fn init_logging(
    format: LogFormat,
    access_buffer: usize,
    counts_access: bool,
) -> tracing_appender::non_blocking::WorkerGuard {
    use tracing_subscriber::filter::{FilterExt, filter_fn};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{Layer, fmt};
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_env("TOLLGATE_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
    };
    // A buffer in front of stderr: the writer thread flushes it whenever it has caught up, so
    // a busy second costs a few writes rather than one per line.
    let (access_out, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(access_buffer)
        .lossy(true)
        .thread_name("tollgate-access-log")
        .finish(std::io::BufWriter::with_capacity(64 * 1024, WholeWrites));
    if counts_access {
        let dropped = access_out.error_counter();
        let _ = tollgate_telemetry::metrics::ACCESS_LINES_DROPPED
            .set(Box::new(move || dropped.dropped_lines() as u64));
    }
    let is_access = || filter_fn(|m| m.target() == ACCESS);
    match format {
        LogFormat::Human => {
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
            let logs = fmt::layer()
                .with_ansi(ansi)
                .with_writer(std::io::stderr)
                .with_filter(filter().and(is_access().not()));
            let access = fmt::layer()
                .with_ansi(ansi)
                .with_writer(access_out)
                .with_filter(filter().and(is_access()));
            tracing_subscriber::registry().with(logs).with(access).init();
        }
        LogFormat::Json => {
            let startup = fmt::layer()
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_span_list(false)
                .with_writer(std::io::stdout)
                .with_filter(filter_fn(|m| m.target() == STARTUP));
            let logs = fmt::layer()
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_writer(std::io::stderr)
                .with_filter(filter().and(filter_fn(|m| m.target() != STARTUP && m.target() != ACCESS)));
            let access = fmt::layer()
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_writer(access_out)
                .with_filter(filter().and(is_access()));
            tracing_subscriber::registry()
                .with(startup)
                .with(logs)
                .with(access)
                .init();
            // A panic's default report is plain text on stderr: log it as one event instead.
            std::panic::set_hook(Box::new(|info| {
                let location = info
                    .location()
                    .map(|l| format!("{}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                let payload = info.payload();
                let message = payload
                    .downcast_ref::<&str>()
                    .copied()
                    .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                    .unwrap_or("(a panic without a message)");
                tracing::error!(target: "tollgate::panic", location, "panic: {message}");
            }));
        }
    }
    guard
}

/// The writer of `--access-log-format` lines: stderr through the same 64 KiB buffer, each line
/// one write, and its dropped lines counted in `tollgate_access_lines_dropped_total`.
fn start_access_log(
    format: AccessLogFormat,
    buffer: usize,
    instance: String,
) -> Result<(access::AccessLog, access::Flush)> {
    let (log, flush) = access::start(
        format,
        buffer,
        instance,
        std::io::BufWriter::with_capacity(64 * 1024, WholeWrites),
    )
    .context("cannot start the access log's writer thread")?;
    let counted = log.clone();
    let _ = tollgate_telemetry::metrics::ACCESS_LINES_DROPPED.set(Box::new(move || counted.dropped()));
    Ok((log, flush))
}

/// Whether the command line asks for json logs from `serve` or `demo`, read before clap has
/// parsed it (for clap's own errors).
fn json_asked(args: &[std::ffi::OsString]) -> bool {
    let args: Vec<&str> = args.iter().skip(1).filter_map(|a| a.to_str()).collect();
    if !matches!(args.first(), Some(&"serve") | Some(&"demo")) {
        return false;
    }
    let flag = args.windows(2).any(|w| w[0] == "--log-format" && w[1] == "json")
        || args.contains(&"--log-format=json");
    flag || std::env::var("TOLLGATE_LOG_FORMAT").is_ok_and(|v| v == "json")
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
    }
}

fn announce_plain(running: &app::Running, snap: &tollgate_rules::Snapshot, scheme: &str, demo: bool) {
    println!(
        "tollgate listening on {scheme}://{} (store: {}, rules version {} from {})",
        running.addr,
        running.store.kind(),
        snap.version,
        snap.source
    );
    if let Some(a) = running.admin_addr {
        println!("admin listening on http://{a}");
    }
    if demo {
        match running.demo_upstreams.as_slice() {
            [] => {}
            [u] => println!("demo upstream \"orders\" on http://{u}"),
            several => {
                for (i, u) in several.iter().enumerate() {
                    println!("demo upstream instance orders-{} on http://{u}", i + 1);
                }
            }
        }
        println!("demo keys:");
        for k in &snap.keys {
            println!("  {:<6} {}", &*k.id, k.name.as_deref().unwrap_or(""));
        }
        println!(
            "try: curl -i -H 'Authorization: Bearer k7-demo-key' {scheme}://{}/v1/orders",
            running.addr
        );
        if let Some(path) = usage_path(snap) {
            println!(
                "budget: curl -s -H 'X-API-Key: k7-demo-key' {scheme}://{}{path}",
                running.addr
            );
        }
        if snap.jwt.is_some() {
            println!(
                "JWT: curl -i -H \"Authorization: Bearer $(tollgate demo-token --sub k-7)\" {scheme}://{}/v2/orders",
                running.addr
            );
        }
    }
}

/// The path of a route that answers a GET with the caller's budget, for the demo's hint.
fn usage_path(snap: &tollgate_rules::Snapshot) -> Option<&str> {
    snap.routes
        .iter()
        .find(|r| {
            r.serves == tollgate_rules::Serves::Usage && r.method.as_ref().is_none_or(|m| m.as_str() == "GET")
        })
        .map(|r| &*r.prefix)
}

/// The same as [`announce_plain`], each line an event with its values as fields.
fn announce_json(running: &app::Running, snap: &tollgate_rules::Snapshot, scheme: &str, demo: bool) {
    tracing::info!(
        target: STARTUP,
        addr = %running.addr,
        url = %format_args!("{scheme}://{}", running.addr),
        store = running.store.kind(),
        rules_version = snap.version,
        rules_source = %snap.source,
        "tollgate listening"
    );
    if let Some(a) = running.admin_addr {
        tracing::info!(target: STARTUP, addr = %a, url = %format_args!("http://{a}"), "admin listening");
    }
    if demo {
        if let Some(u) = running.demo_upstream {
            tracing::info!(target: STARTUP, addr = %u, url = %format_args!("http://{u}"), upstream = "orders", "demo upstream listening");
        }
        for k in &snap.keys {
            tracing::info!(target: STARTUP, id = &*k.id, name = k.name.as_deref().unwrap_or(""), "demo key");
        }
        tracing::info!(
            target: STARTUP,
            command = %format_args!("curl -i -H 'Authorization: Bearer k7-demo-key' {scheme}://{}/v1/orders", running.addr),
            "try"
        );
        if let Some(path) = usage_path(snap) {
            tracing::info!(
                target: STARTUP,
                command = %format_args!("curl -s -H 'X-API-Key: k7-demo-key' {scheme}://{}{path}", running.addr),
                "try the caller's budget"
            );
        }
        if snap.jwt.is_some() {
            tracing::info!(
                target: STARTUP,
                command = %format_args!("curl -i -H \"Authorization: Bearer $(tollgate demo-token --sub k-7)\" {scheme}://{}/v2/orders", running.addr),
                "try the JWT route"
            );
        }
    }
}

async fn run_gateway(cfg: GatewayConfig, demo: bool, format: LogFormat) -> Result<()> {
    let scheme = if cfg.tls.is_some() { "https" } else { "http" };
    let running = app::start(cfg).await.context("tollgate could not start")?;
    let snap = running.rules.load();
    match format {
        LogFormat::Human => announce_plain(&running, &snap, scheme, demo),
        LogFormat::Json => announce_json(&running, &snap, scheme, demo),
    }
    drop(snap);
    shutdown_signal().await;
    let open = running.drain(shutdown_signal()).await;
    if open > 0 {
        tracing::warn!(open, "exited with connections still open after the drain timeout");
    }
    Ok(())
}

fn main() -> Result<()> {
    // Freed memory goes back to the system within the decay time even while the process idles.
    let _ = tikv_jemalloc_ctl::background_thread::write(true);
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = parse_or_exit(&args);
    if run_standalone(&cli.command)? {
        return Ok(());
    }
    run_server(cli)
}

/// The command line, or the process ends with clap's message: in json mode, as one event.
fn parse_or_exit(args: &[std::ffi::OsString]) -> Cli {
    match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() && json_asked(args) => {
            let _access_log = init_logging(LogFormat::Json, DEFAULT_ACCESS_BUFFER, true);
            tracing::error!("{}", e.to_string().trim_end());
            std::process::exit(e.exit_code());
        }
        Err(e) => e.exit(),
    }
}

/// Runs a command that serves nothing to its end, each with the logging it needs, if any, and
/// says whether it was one; `serve`, `demo` and `demo-upstream` are left to [`run_server`].
fn run_standalone(command: &Command) -> Result<bool> {
    match command {
        // Offline and single-threaded: no logging, no async runtime. The error names the
        // file, row and column already; a backtrace would only bury it.
        Command::Replay(a) => {
            // Exit status 3 holds a proposal back (`--max-newly-refused`); 1 is a failure.
            if let Err(e) = tollgate_replay::args::main(a) {
                eprintln!("tollgate replay: {e}");
                std::process::exit(e.exit_code());
            }
        }
        // Runs its own runtime and child processes, and reports on stdout.
        Command::Fleet(a) => exit_on_error("fleet", tollgate_fleet::main(a)),
        Command::Regions(a) => {
            // A model on a virtual clock: no logging, no runtime.
            let RegionsCommand::Simulate { run, json } = &a.command;
            let report = tollgate_regions::sim::simulate(&run.scenario());
            if *json {
                println!("{}", report.json());
            } else {
                print!("{}", report.table());
            }
        }
        Command::Meter(a) => {
            // Runs its own runtime; errors name the flag, file or field already.
            let _access_log = init_logging(LogFormat::Human, DEFAULT_ACCESS_BUFFER, true);
            exit_on_error("meter", tollgate_meter::cli::main(a));
        }
        Command::DemoToken {
            sub,
            org,
            plan,
            exp_seconds,
        } => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .context("the clock is before 1970")?
                .as_secs();
            let t = tollgate_gateway::demo::DemoToken {
                sub: sub.clone(),
                org: org.clone(),
                plan: plan.clone(),
                exp_seconds: *exp_seconds,
            };
            let token = tollgate_gateway::demo::demo_token(&t, now);
            exit_on_error("demo-token", token.map(|token| println!("{token}")));
        }
        Command::RulesSchema => print!("{}", tollgate_rules::raw::schema()),
        Command::CheckStore { store, clock } => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("an async runtime")?;
            let found = rt.block_on(tollgate_gateway::app::check_store(store, *clock));
            exit_on_error("check-store", found.map(|line| println!("{line}")));
        }
        Command::Healthcheck { admin_listen, path } => {
            exit_on_error("healthcheck", healthcheck(*admin_listen, path));
        }
        Command::CheckRules { file, cluster: _ } => {
            match tollgate_rules::load(file, tollgate_rules::CompileOptions::default()) {
                Ok(snap) => print!("{}", tollgate_rules::summary::summary(&snap)),
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(1);
                }
            }
        }
        Command::Serve(_) | Command::Demo(_) | Command::DemoUpstream { .. } => return Ok(false),
    }
    Ok(true)
}

/// One `GET` of `path` on the admin listener at `addr`, over plain blocking TCP: a probe needs
/// no runtime, and must finish well inside a HEALTHCHECK's timeout.
fn healthcheck(mut addr: SocketAddr, path: &str) -> Result<(), String> {
    use std::io::{Read, Write};
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let limit = std::time::Duration::from_secs(3);
    let mut tcp = std::net::TcpStream::connect_timeout(&addr, limit).map_err(|e| format!("{addr}: {e}"))?;
    tcp.set_read_timeout(Some(limit)).map_err(|e| e.to_string())?;
    write!(
        tcp,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("{addr}: {e}"))?;
    let mut answer = Vec::new();
    let _ = tcp.take(4096).read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    let status = text.lines().next().unwrap_or("");
    if status.starts_with("HTTP/1.1 200") {
        Ok(())
    } else {
        Err(format!("http://{addr}{path} answered {status:?}"))
    }
}

/// Ends the process with status 1 and `tollgate <command>: <error>` on stderr when `r` failed.
fn exit_on_error<E: std::fmt::Display>(command: &str, r: Result<(), E>) {
    if let Err(e) = r {
        eprintln!("tollgate {command}: {e}");
        std::process::exit(1);
    }
}

/// Sets up logging and, when asked for, the access log, then runs the server `cli` names.
fn run_server(cli: Cli) -> Result<()> {
    let (format, threads, access_buffer, access_format, instance) = match &cli.command {
        Command::Serve(a) => (
            a.common.log_format,
            a.common.threads,
            a.common.access_log_buffer,
            a.common.access_log_format,
            a.common.instance.clone(),
        ),
        Command::Demo(a) => (
            a.common.log_format,
            a.common.threads,
            a.common.access_log_buffer,
            a.common.access_log_format,
            a.common.instance.clone(),
        ),
        Command::DemoUpstream { .. }
        | Command::CheckRules { .. }
        | Command::CheckStore { .. }
        | Command::RulesSchema
        | Command::Replay(_)
        | Command::Fleet(_)
        | Command::Meter(_)
        | Command::DemoToken { .. }
        | Command::Healthcheck { .. }
        | Command::Regions(_) => (LogFormat::Human, None, DEFAULT_ACCESS_BUFFER, None, None),
    };
    // Held to the end: dropping them writes the access lines still waiting.
    let access_log = init_logging(format, access_buffer, access_format.is_none());
    let (lines, formatted) = match access_format
        .map(|f| start_access_log(f, access_buffer, instance.unwrap_or_else(host_name)))
        .transpose()?
    {
        Some((log, flush)) => (Some(log), Some(flush)),
        None => (None, None),
    };
    match run(cli, threads, format, lines) {
        // Errors name the flag, file or field already; in json mode they are one event too.
        Err(e) if format == LogFormat::Json => {
            tracing::error!("{}", one_line(&e));
            drop(formatted);
            drop(access_log);
            std::process::exit(1);
        }
        r => r,
    }
}

/// An error and its causes on one line, leaving out a cause its error already spells out.
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain().map(|c| c.to_string()) {
        if !out.contains(&cause) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&cause);
        }
    }
    out
}

/// Runs `serve`, `demo` or `demo-upstream` on a runtime of `threads`.
fn run(cli: Cli, threads: Option<u16>, format: LogFormat, lines: Option<access::AccessLog>) -> Result<()> {
    let gateway = matches!(cli.command, Command::Serve(_) | Command::Demo(_));
    // One thread: the current-thread scheduler, with no work-stealing machinery to pay for. A
    // gateway's main thread is its first shard and also runs what is not a connection's (the
    // admin listener, reloads, the store's clients); its other shards start their own
    // runtimes (`server::run_shards`).
    let mut rt = match threads {
        _ if gateway => tokio::runtime::Builder::new_current_thread(),
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n as usize);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = rt
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        match cli.command {
            Command::Serve(a) => {
                let mut cfg = a
                    .common
                    .gateway_config(RulesSource::File(a.rules.clone()), false)
                    .map_err(anyhow::Error::msg)?;
                cfg.access_log = lines;
                run_gateway(cfg, false, format).await
            }
            Command::Demo(a) => {
                let rules = match &a.rules {
                    Some(p) => RulesSource::File(p.clone()),
                    None => RulesSource::demo(),
                };
                let mut cfg = a.common.gateway_config(rules, true).map_err(anyhow::Error::msg)?;
                cfg.access_log = lines;
                cfg.demo_targets = a.targets;
                run_gateway(cfg, true, format).await
            }
            // These returned before the runtime started.
            Command::CheckRules { .. }
            | Command::CheckStore { .. }
            | Command::RulesSchema
            | Command::Replay(_)
            | Command::Fleet(_)
            | Command::Meter(_)
            | Command::DemoToken { .. }
            | Command::Healthcheck { .. }
            | Command::Regions(_) => Ok(()),
            Command::DemoUpstream {
                listen,
                workers,
                latency_ms,
                instance,
            } => {
                let upstream = tollgate_gateway::demo::DemoUpstream {
                    instance: instance.map(Into::into),
                };
                let pool = match workers {
                    Some(n) => Some(
                        tollgate_gateway::demo::Workers::new(n, std::time::Duration::from_millis(latency_ms))
                            .map_err(anyhow::Error::msg)?
                            .serving(upstream.clone()),
                    ),
                    None => None,
                };
                let l = tokio::net::TcpListener::bind(listen)
                    .await
                    .with_context(|| format!("cannot listen on {listen}"))?;
                println!("demo upstream listening on http://{}", l.local_addr()?);
                let limits = ServerLimits::default();
                match pool {
                    Some(p) => {
                        server::run(l, None, Arc::new(p), limits, shutdown_signal()).await;
                    }
                    None => {
                        let demo = Arc::new(upstream);
                        server::run(l, None, demo, limits, shutdown_signal()).await;
                    }
                }
                Ok(())
            }
        }
    })
}
