//! The load driver: the storm's closed-loop workers on one key, round-robin over the gateways,
//! and the other partners' paced traffic beside it. Every answer is recorded with its send and
//! answer times, its gateway and its status, and one example of each unexpected answer is kept.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, HeaderValue};
use http::{Request, Uri};
use http_body_util::{BodyExt, Empty};
use tokio::time::{Instant, sleep_until, timeout};

use crate::procs::HttpClient;

/// A request that gets no answer within this long counts as a transport error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Status recorded for a request that got no HTTP answer (refused, reset, timed out).
pub(crate) const NO_ANSWER: u16 = 0;
/// Who sent a request: the storm, or partner `i` as `PARTNER0 + i`.
pub(crate) const STORM: u16 = 0;
pub(crate) const PARTNER0: u16 = 1;
/// The other partners' workers each send every this long, like the storm's padding.
const PARTNER_PERIOD_MS: u64 = 100;

/// One request's answer, or `NO_ANSWER`, with its times.
#[derive(Clone, Copy, Debug)]
pub struct Answer {
    /// Microseconds from the start of the load.
    pub send_us: u64,
    pub recv_us: u64,
    pub gateway: u16,
    pub who: u16,
    /// The HTTP status, or `NO_ANSWER`.
    pub status: u16,
}

/// One gateway as the driver sees it.
#[derive(Clone)]
pub struct Target {
    pub client: HttpClient,
    pub uri: Uri,
}

pub struct LoadSpec {
    pub duration: Duration,
    pub workers: u32,
    /// `None` floods.
    pub pad: Option<Duration>,
    pub storm_key: String,
    pub partner_keys: Vec<String>,
    pub others_rate: u32,
}

fn bearer(secret: &str) -> Result<HeaderValue, String> {
    HeaderValue::from_str(&format!("Bearer {secret}"))
        .map_err(|_| format!("API key {secret:?} can't be sent in a header"))
}

/// The status, and for an unexpected answer (neither 2xx nor 429, or none) what it said.
async fn send(t: &Target, auth: &HeaderValue) -> (u16, Option<String>) {
    let req = Request::get(t.uri.clone())
        .header(AUTHORIZATION, auth.clone())
        .body(Empty::<Bytes>::new())
        .expect("a GET with a valid URI and header");
    let answer = async {
        let resp = t.client.request(req).await.map_err(|e| format!("{e:?}"))?;
        let status = resp.status().as_u16();
        // Read the body whole so the connection goes back to the pool.
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{status}, then the body failed: {e:?}"))?
            .to_bytes();
        let odd = !(200..300).contains(&status) && status != 429;
        Ok::<_, String>((
            status,
            odd.then(|| String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned()),
        ))
    };
    match timeout(REQUEST_TIMEOUT, answer).await {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => (NO_ANSWER, Some(e)),
        Err(_) => (NO_ANSWER, Some(format!("no answer within {REQUEST_TIMEOUT:?}"))),
    }
}

/// What the load produced: every answer, and one example of each unexpected answer.
#[derive(Default)]
pub struct Outcome {
    pub answers: Vec<Answer>,
    /// The first body (or transport error) seen for each status other than 2xx and 429.
    pub samples: BTreeMap<u16, String>,
}

/// How a worker picks its gateway.
enum Spread {
    /// The next gateway after the fleet's last storm request, as a round-robin load balancer.
    Shared(Arc<AtomicUsize>),
    /// This worker's own rotation over every gateway, so each partner reaches them all.
    Own(usize),
}

struct Worker {
    who: u16,
    auth: HeaderValue,
    first: Instant,
    period: Option<Duration>,
    spread: Spread,
}

async fn work(w: Worker, t0: Instant, deadline: Instant, targets: Arc<Vec<Target>>) -> Outcome {
    let mut out = Outcome {
        answers: Vec::with_capacity(256),
        samples: BTreeMap::new(),
    };
    let n = targets.len();
    let mut own = match w.spread {
        Spread::Own(start) => start,
        Spread::Shared(_) => 0,
    };
    sleep_until(w.first).await;
    // The send schedule: a padded worker sends `period` after its last scheduled send, or at
    // once when the answer came later than that. Scheduling from the schedule rather than from
    // the actual send keeps timer lateness (tokio rounds sleeps up to the next millisecond) from
    // stretching every period, so 40 workers at 100 ms really offer 400/s.
    let mut scheduled = w.first;
    loop {
        let start = Instant::now();
        if start >= deadline {
            break;
        }
        let g = match &w.spread {
            Spread::Shared(c) => c.fetch_add(1, Ordering::Relaxed) % n,
            Spread::Own(_) => {
                own = (own + 1) % n;
                own
            }
        };
        let (status, odd) = send(&targets[g], &w.auth).await;
        let end = Instant::now();
        if let Some(text) = odd {
            out.samples.entry(status).or_insert(text);
        }
        out.answers.push(Answer {
            send_us: (start - t0).as_micros() as u64,
            recv_us: (end - t0).as_micros() as u64,
            gateway: g as u16,
            who: w.who,
            status,
        });
        if let Some(p) = w.period {
            scheduled = (scheduled + p).max(end);
            sleep_until(scheduled).await;
        }
    }
    out
}

/// Runs the load from `t0` for its duration; returns every answer, in no order.
pub async fn run_load(traffic: &LoadSpec, targets: Arc<Vec<Target>>, t0: Instant) -> Result<Outcome, String> {
    let deadline = t0 + traffic.duration;
    let storm_auth = bearer(&traffic.storm_key)?;
    let partner_auth: Vec<HeaderValue> = traffic
        .partner_keys
        .iter()
        .map(|k| bearer(k))
        .collect::<Result<_, _>>()?;
    let rr = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..traffic.workers {
        // Spread the first requests over one padding so arrivals are even: one every 2.5 ms
        // for 40 workers at 100 ms.
        let offset = traffic.pad.map_or(Duration::ZERO, |p| p * i / traffic.workers);
        let w = Worker {
            who: STORM,
            auth: storm_auth.clone(),
            first: t0 + offset,
            period: traffic.pad,
            spread: Spread::Shared(rr.clone()),
        };
        tasks.push(tokio::spawn(work(w, t0, deadline, targets.clone())));
    }
    if traffic.others_rate > 0 {
        // Workers of PARTNER_PERIOD_MS each; the period is stretched so the total is exact.
        let count = traffic.others_rate.div_ceil((1000 / PARTNER_PERIOD_MS) as u32);
        let period = Duration::from_secs_f64(f64::from(count) / f64::from(traffic.others_rate));
        let n = targets.len();
        for i in 0..count {
            let p = i as usize % partner_auth.len();
            let w = Worker {
                who: PARTNER0 + p as u16,
                auth: partner_auth[p].clone(),
                first: t0 + period * i / count,
                period: Some(period),
                spread: Spread::Own((i as usize * 7) % n),
            };
            tasks.push(tokio::spawn(work(w, t0, deadline, targets.clone())));
        }
    }
    let mut all = Outcome::default();
    for t in tasks {
        let o = t.await.map_err(|e| format!("a load worker failed: {e}"))?;
        all.answers.extend(o.answers);
        for (k, v) in o.samples {
            all.samples.entry(k).or_insert(v);
        }
    }
    Ok(all)
}
