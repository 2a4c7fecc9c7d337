//! A slow backend with real processes: `tollgate demo-upstream` with 80 workers at 250 ms
//! (320 a second at most), `tollgate serve` in front of it, and this driver offering 700 a
//! second for 20 s, open loop (paced, each request on its own task, a new connection whenever
//! none is idle). Once without adaptive concurrency, once with it; it prints both side by side
//! (the table in benches/README.md "Overload").
//!
//! Latency is counted from when a request was due, not when it went out, so a driver that
//! falls behind can't hide a queue.
//!
//! Run: `cargo bench --bench overload` (options after `--`: `--rate 700 --seconds 20
//! --workers 80 --latency-ms 250 --only off|adaptive`). Under `cargo test --all-targets` it
//! only says how to run it.

#[path = "../tests/common/mod.rs"]
mod common;

use common::bench::arg;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use common::{DemoUpstreamProc, Tollgate};

/// One request as the driver saw it, in µs from the run's start.
#[derive(Debug, Clone, Copy)]
struct Seen {
    due: u64,
    /// When its task began sending: later than `due` when the driver fell behind.
    sent: u64,
    done: u64,
    /// 0: the request failed (connection error).
    status: u16,
    retry_after: bool,
}

impl Seen {
    fn took(&self) -> u64 {
        self.done.saturating_sub(self.due)
    }

    fn took_since_sent(&self) -> u64 {
        self.done.saturating_sub(self.sent)
    }
}

/// The `q` quantile of `v` (sorted here), in ms.
fn q_ms(v: &mut [u64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 * q) as usize).min(v.len() - 1);
    v[i] as f64 / 1000.0
}

async fn drive(url: &str, rate: f64, seconds: f64) -> Vec<Seen> {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    let client: Client<HttpConnector, Empty<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(http);
    let uri: http::Uri = url.parse().unwrap();
    let start = Instant::now();
    let total = (rate * seconds) as u64;
    let gap = Duration::from_secs_f64(1.0 / rate);
    let seen = Arc::new(std::sync::Mutex::new(Vec::with_capacity(total as usize)));
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        let due = start + gap.mul_f64(i as f64);
        tokio::time::sleep_until(due.into()).await;
        let (client, uri, seen) = (client.clone(), uri.clone(), seen.clone());
        tasks.push(tokio::spawn(async move {
            let due_us = due.duration_since(start).as_micros() as u64;
            let sent = start.elapsed().as_micros() as u64;
            let (status, retry_after) = match client.get(uri).await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let ra = resp.headers().contains_key("retry-after");
                    match resp.into_body().collect().await {
                        Ok(_) => (status, ra),
                        Err(_) => (0, false),
                    }
                }
                Err(_) => (0, false),
            };
            let done = start.elapsed().as_micros() as u64;
            seen.lock().unwrap().push(Seen {
                due: due_us,
                sent,
                done,
                status,
                retry_after,
            });
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    Arc::try_unwrap(seen).unwrap().into_inner().unwrap()
}

struct Report {
    sent: usize,
    ok: usize,
    shed: usize,
    failed: usize,
    ok_p50: f64,
    ok_p99: f64,
    ok_max: f64,
    /// Median wait of the requests due in the second after 10 s (the queue's wait "after 10 s").
    at_10s: f64,
    /// 200s answered within the run, per second; and from 5 s on.
    goodput: f64,
    goodput_late: f64,
    shed_p50: f64,
    shed_p99: f64,
    shed_max: f64,
    shed_within_10ms: f64,
    /// The same from when the driver sent them, apart from its own lateness.
    shed_sent_p99: f64,
    shed_sent_within_10ms: f64,
    /// How late the driver sent: p99 and max, ms.
    lag_p99: f64,
    lag_max: f64,
    shed_retry_after: bool,
    /// 200s answered after the last request was due: the queue left behind.
    after_end: usize,
}

fn report(seen: &[Seen], seconds: f64) -> Report {
    let end = (seconds * 1e6) as u64;
    let ok: Vec<&Seen> = seen.iter().filter(|s| s.status == 200).collect();
    let shed: Vec<&Seen> = seen.iter().filter(|s| s.status == 503).collect();
    let mut ok_lat: Vec<u64> = ok.iter().map(|s| s.took()).collect();
    let mut shed_lat: Vec<u64> = shed.iter().map(|s| s.took()).collect();
    let mut shed_sent: Vec<u64> = shed.iter().map(|s| s.took_since_sent()).collect();
    let mut lag: Vec<u64> = seen.iter().map(|s| s.sent.saturating_sub(s.due)).collect();
    let share = |v: &[&Seen], f: &dyn Fn(&Seen) -> u64| {
        if v.is_empty() {
            f64::NAN
        } else {
            100.0 * v.iter().filter(|s| f(s) <= 10_000).count() as f64 / v.len() as f64
        }
    };
    let mut mid: Vec<u64> = ok
        .iter()
        .filter(|s| (10_000_000..11_000_000).contains(&s.due))
        .map(|s| s.took())
        .collect();
    let in_run = ok.iter().filter(|s| s.done <= end).count();
    let late = ok.iter().filter(|s| s.done > 5_000_000 && s.done <= end).count();
    Report {
        sent: seen.len(),
        ok: ok.len(),
        shed: shed.len(),
        failed: seen.len() - ok.len() - shed.len(),
        ok_p50: q_ms(&mut ok_lat, 0.50),
        ok_p99: q_ms(&mut ok_lat, 0.99),
        ok_max: q_ms(&mut ok_lat, 1.0),
        at_10s: q_ms(&mut mid, 0.5),
        goodput: in_run as f64 / seconds,
        goodput_late: late as f64 / (seconds - 5.0),
        shed_p50: q_ms(&mut shed_lat, 0.50),
        shed_p99: q_ms(&mut shed_lat, 0.99),
        shed_max: q_ms(&mut shed_lat, 1.0),
        shed_within_10ms: share(&shed, &|s| s.took()),
        shed_sent_p99: q_ms(&mut shed_sent, 0.99),
        shed_sent_within_10ms: share(&shed, &|s| s.took_since_sent()),
        lag_p99: q_ms(&mut lag, 0.99),
        lag_max: q_ms(&mut lag, 1.0),
        shed_retry_after: shed.iter().all(|s| s.retry_after),
        after_end: ok.len() - in_run,
    }
}

fn rules(upstream: std::net::SocketAddr, adaptive: bool) -> String {
    let concurrency = if adaptive {
        r#", "concurrency": {"adaptive": true, "min": 4, "max": 2000}"#
    } else {
        ""
    };
    format!(
        r#"{{"version": 1,
            "upstreams": {{"orders": {{"url": "http://{upstream}", "timeout_ms": 60000{concurrency}}}}},
            "routes": [{{"method": "GET", "path": "/v1/orders", "upstream": "orders", "key": "optional"}}]}}"#
    )
}

fn run(adaptive: bool, rate: f64, seconds: f64, workers: u32, latency_ms: u64) -> Report {
    // A runtime of its own: the run before leaves thousands of connections closing, which
    // would make this run's driver late.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let up = DemoUpstreamProc::spawn(workers, latency_ms);
    let (_dir, path) = common::rules_file(&rules(up.addr, adaptive));
    let gw = Tollgate::spawn_with_env(
        &["serve", "--rules", path.to_str().unwrap(), "--store", "memory"],
        // One access line per request is not what this measures.
        &[("TOLLGATE_LOG", "warn")],
    );
    let seen = rt.block_on(drive(&gw.url("/v1/orders"), rate, seconds));
    let r = report(&seen, seconds);
    if adaptive {
        let metrics = rt.block_on(async {
            let client: Client<HttpConnector, Empty<Bytes>> =
                Client::builder(TokioExecutor::new()).build(HttpConnector::new());
            let resp = client.get(gw.admin_url("/metrics").parse().unwrap()).await.ok()?;
            let body = resp.into_body().collect().await.ok()?.to_bytes();
            Some(String::from_utf8_lossy(&body).into_owned())
        });
        for line in metrics.unwrap_or_default().lines() {
            if ["concurrency_limit", "in_flight", "shed"]
                .iter()
                .any(|m| line.starts_with(&format!("tollgate_upstream_{m}")))
            {
                println!("  {line}");
            }
        }
    }
    r
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("overload: a benchmark, not a test; run `cargo bench --bench overload`");
        return;
    }
    let rate: f64 = arg("--rate", 700.0);
    let seconds: f64 = arg("--seconds", 20.0);
    let workers: u32 = arg("--workers", 80);
    let latency_ms: u64 = arg("--latency-ms", 250);
    let only: String = arg("--only", String::new());
    println!("{}", tollgate_testkit::machine_line());
    println!(
        "slow backend: demo-upstream {workers} workers x {latency_ms} ms (at most {:.0}/s), {rate}/s offered for {seconds} s",
        f64::from(workers) * 1000.0 / latency_ms as f64
    );
    let mut runs = vec![];
    for (adaptive, name) in [(false, "off"), (true, "adaptive")] {
        if !only.is_empty() && only != name {
            continue;
        }
        println!("run: {name}");
        runs.push((name, run(adaptive, rate, seconds, workers, latency_ms)));
    }
    let row = |label: &str, f: &dyn Fn(&Report) -> String| {
        let cells: Vec<String> = runs.iter().map(|(_, r)| f(r)).collect();
        println!("| {label} | {} |", cells.join(" | "));
    };
    let names: Vec<&str> = runs.iter().map(|(n, _)| *n).collect();
    println!("| | {} |", names.join(" | "));
    println!("|---|{}", "---|".repeat(runs.len()));
    row("requests sent", &|r| r.sent.to_string());
    row("200 (admitted and served)", &|r| r.ok.to_string());
    row("503 upstream_overloaded (shed)", &|r| r.shed.to_string());
    row("failed (no answer)", &|r| r.failed.to_string());
    row("200s: p50 / p99 / max latency", &|r| {
        format!("{:.0} / {:.0} / {:.0} ms", r.ok_p50, r.ok_p99, r.ok_max)
    });
    row("200s due at 10-11 s: median wait", &|r| {
        format!("{:.0} ms", r.at_10s)
    });
    row("goodput, whole run / from 5 s", &|r| {
        format!("{:.0}/s / {:.0}/s", r.goodput, r.goodput_late)
    });
    row("200s answered after the run ended", &|r| r.after_end.to_string());
    row("shed: p50 / p99 / max latency", &|r| {
        format!("{:.1} / {:.1} / {:.1} ms", r.shed_p50, r.shed_p99, r.shed_max)
    });
    row("shed answered within 10 ms", &|r| {
        format!("{:.1}%", r.shed_within_10ms)
    });
    row("shed, from when sent: p99 / within 10 ms", &|r| {
        format!("{:.1} ms / {:.1}%", r.shed_sent_p99, r.shed_sent_within_10ms)
    });
    row("driver lateness: p99 / max", &|r| {
        format!("{:.1} / {:.1} ms", r.lag_p99, r.lag_max)
    });
    row("every shed answer had Retry-After", &|r| {
        if r.shed == 0 {
            "-".into()
        } else {
            r.shed_retry_after.to_string()
        }
    });
}
