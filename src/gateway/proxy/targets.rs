//! An upstream's targets as they live between requests: each one's kept connections, requests
//! in flight and failures in a row; which target a request goes to (least request, round
//! robin, or a hash of the caller), which ones are left out for failing (passive ejection, with
//! panic mode when every one is), and the budget that bounds retries on another target. Both
//! wires reach it through the one client (`proxy::client::exchange`), so they choose alike.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use http::uri::Authority;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tollgate_rules::{Balance, Eject, Health, MAX_EJECTION, Retries, Upstream};
use tollgate_telemetry::metrics::{Metrics, RetryReason, TargetLabel, TargetOutcome};

use tollgate_http1::response::Parsed;

use super::names::Names;
use super::pool::ConnPool;

/// The fewest retries an upstream's budget allows in its window, however few its requests:
/// an upstream that serves a request a second may still retry the one that failed.
const MIN_RETRIES: u64 = 10;

/// The retry budget's window, in one-second slots.
const WINDOW_S: usize = 10;

/// Milliseconds since the first call: the clock of ejections.
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// How an attempt on a target ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// An answer that is not 502, 503 or 504.
    Ok,
    /// 502, 503 or 504.
    ErrorStatus,
    ConnectFailure,
    /// The connection closed before any byte of an answer.
    Reset,
    Timeout,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::ErrorStatus => "error_status",
            Outcome::ConnectFailure => "connect_failure",
            Outcome::Reset => "reset",
            Outcome::Timeout => "timeout",
        }
    }

    /// Whether it counts towards ejecting the target.
    fn failed(self) -> bool {
        matches!(
            self,
            Outcome::ErrorStatus | Outcome::ConnectFailure | Outcome::Reset
        )
    }
}

/// What outlasts a rules snapshot of one target: kept across reloads while its address stays.
pub(crate) struct TargetState {
    in_flight: AtomicU32,
    failures: AtomicU32,
    /// While above now: ejected until then (ms of [`now_ms`]).
    ejected_until: AtomicU64,
    /// Ejections in a row: each doubles the next one's length; a success after the return
    /// starts them again.
    ejections: AtomicU32,
    /// Back from an ejection and not yet answered well: one failure ejects it again.
    probation: AtomicBool,
    /// What the active health checks say: false after `unhealthy_after` failed checks in a
    /// row, true again after `healthy_after` passed ones.
    healthy: AtomicBool,
    /// Checks in a row that passed, and that failed.
    checks_passed: AtomicU32,
    checks_failed: AtomicU32,
    /// When the next check is due (ms of [`now_ms`]), and whether one is out.
    next_check: AtomicU64,
    checking: AtomicBool,
    last_failure: Mutex<Option<(u64, String)>>,
    counts: [Counter; 5],
    up: Gauge,
    ejected_total: Counter,
}

/// One target of an upstream.
pub(crate) struct Target {
    pub authority: Authority,
    /// `host:port`, for labels and the admin API.
    pub label: Arc<str>,
    /// The `host:port` it was found under, when a name gave its address.
    pub name: Option<Arc<str>>,
    pub weight: u32,
    /// At most this many requests in flight to it (`u32::MAX`: no cap of its own).
    pub cap: u32,
    pub pool: Arc<ConnPool>,
    pub state: Arc<TargetState>,
}

/// Retries of the last [`WINDOW_S`] seconds against requests, in one-second slots.
#[derive(Default)]
struct Budget {
    slots: [(AtomicU64, AtomicU64, AtomicU64); WINDOW_S],
}

impl Budget {
    /// The slot of second `s`, emptied when it last counted another second.
    fn slot(&self, s: u64) -> &(AtomicU64, AtomicU64, AtomicU64) {
        let slot = &self.slots[(s % WINDOW_S as u64) as usize];
        if slot.0.swap(s, Ordering::AcqRel) != s {
            slot.1.store(0, Ordering::Release);
            slot.2.store(0, Ordering::Release);
        }
        slot
    }

    fn request(&self) {
        self.slot(now_ms() / 1000).1.fetch_add(1, Ordering::AcqRel);
    }

    /// Takes one retry when retries stay within `percent` of the window's requests.
    fn take(&self, percent: u32) -> bool {
        let s = now_ms() / 1000;
        let (mut requests, mut retries) = (0, 0);
        for slot in &self.slots {
            if slot.0.load(Ordering::Acquire) + (WINDOW_S as u64) > s {
                requests += slot.1.load(Ordering::Acquire);
                retries += slot.2.load(Ordering::Acquire);
            }
        }
        let allowed = (requests * u64::from(percent) / 100).max(MIN_RETRIES.min(requests));
        if retries >= allowed {
            return false;
        }
        self.slot(s).2.fetch_add(1, Ordering::AcqRel);
        true
    }
}

/// An upstream's targets and how a request's is chosen.
pub(crate) struct Targets {
    pub list: Vec<Target>,
    balance: Balance,
    eject: Eject,
    pub retries: Retries,
    turn: AtomicU64,
    budget: Arc<Budget>,
    retried: [Counter; 3],
    budget_exhausted: Counter,
}

/// What [`Targets::pick`] is told of the request.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Picking {
    /// The caller's hash, for `"balance": "hash"`.
    pub hash: u64,
}

/// Why a request goes again to another target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RetryWhy {
    ConnectFailure,
    Reset,
    ErrorStatus,
}

impl Targets {
    /// The targets of `u`, each keeping the pool and state of the same address in `prev`. A
    /// target named by a host name is one target per address `names` last learned for it.
    pub fn new(u: &Upstream, prev: Option<&Targets>, metrics: &Metrics, names: &Names) -> Targets {
        let list = members(u, names)
            .into_iter()
            .map(
                |Member {
                     authority,
                     name,
                     weight,
                     cap,
                 }| {
                    let label: Arc<str> = authority.as_str().into();
                    let old = prev.and_then(|p| p.list.iter().find(|o| o.authority == authority));
                    let pool = match old {
                        Some(o)
                            if o.pool.idle_timeout() == u.idle_timeout && o.pool.tls() == u.tls.as_ref() =>
                        {
                            o.pool.clone()
                        }
                        _ => Arc::new(
                            ConnPool::new(authority.clone(), tollgate_rules::CONNECT_TIMEOUT, u.idle_timeout)
                                .with_tls(u.tls.clone())
                                .counting_strays(
                                    metrics
                                        .upstream_strays
                                        .get_or_create(&tollgate_telemetry::metrics::UpstreamLabel {
                                            upstream: u.name.clone(),
                                        })
                                        .clone(),
                                ),
                        ),
                    };
                    let state = match old {
                        Some(o) => o.state.clone(),
                        None => Arc::new(TargetState::new(&u.name, &label, metrics)),
                    };
                    Target {
                        authority,
                        label,
                        name,
                        weight,
                        cap: cap.unwrap_or(u32::MAX),
                        pool,
                        state,
                    }
                },
            )
            .collect();
        let retried = ["connect_failure", "reset", "error_status"].map(|reason| {
            metrics
                .upstream_retries
                .get_or_create(&RetryReason {
                    upstream: u.name.clone(),
                    reason,
                })
                .clone()
        });
        Targets {
            list,
            balance: u.balance,
            eject: u.eject,
            retries: u.retries,
            turn: AtomicU64::new(0),
            // The budget counts the upstream's requests, whatever its addresses are now.
            budget: prev.map_or_else(Default::default, |p| p.budget.clone()),
            retried,
            budget_exhausted: metrics.upstream_retry_budget_exhausted.clone(),
        }
    }

    /// The first target's pool: the only one of a one-target upstream.
    #[cfg(test)]
    pub fn first_pool(&self) -> &Arc<ConnPool> {
        &self.list[0].pool
    }

    /// Whether requests may go to more than one target.
    pub fn several(&self) -> bool {
        self.list.len() > 1
    }

    /// The target for a request's attempt, none of `tried` while another may be chosen:
    /// those neither ejected nor tried, with room under their own `max_in_flight`; when every
    /// untried one with room is ejected, those (panic mode: better a target that may fail than
    /// none); `None` when all were tried or are full.
    pub fn pick(&self, p: Picking, tried: &[usize]) -> Option<usize> {
        if self.list.len() == 1 {
            return (tried.is_empty() && self.list[0].room()).then_some(0);
        }
        let now = now_ms();
        let open = |i: &usize| !tried.contains(i) && self.list[*i].room();
        let mut up: smallvec::SmallVec<[usize; 8]> = (0..self.list.len())
            .filter(open)
            .filter(|&i| self.list[i].state.usable(now))
            .collect();
        if up.is_empty() {
            up = (0..self.list.len()).filter(open).collect();
        }
        match up.len() {
            0 => None,
            1 => Some(up[0]),
            _ => Some(match self.balance {
                Balance::LeastRequest => self.least_request(&up),
                Balance::RoundRobin => self.round_robin(&up),
                Balance::Hash => self.by_hash(&up, p.hash),
            }),
        }
    }

    /// Two of `up` at random, by weight and never the same one twice; the one with fewer
    /// requests in flight per weight.
    fn least_request(&self, up: &[usize]) -> usize {
        let a = self.weighted(up, rand::random::<u64>());
        let rest: smallvec::SmallVec<[usize; 8]> = up.iter().copied().filter(|&i| i != a).collect();
        let b = self.weighted(&rest, rand::random::<u64>());
        let load = |i: usize| {
            let t = &self.list[i];
            u64::from(t.state.in_flight.load(Ordering::Acquire)) * 1_000_000 / u64::from(t.weight)
        };
        if load(b) < load(a) { b } else { a }
    }

    /// One of `up`, each as likely as its weight, for the number `r`.
    fn weighted(&self, up: &[usize], r: u64) -> usize {
        let total: u64 = up.iter().map(|&i| u64::from(self.list[i].weight)).sum();
        let mut at = r % total;
        for &i in up {
            let w = u64::from(self.list[i].weight);
            if at < w {
                return i;
            }
            at -= w;
        }
        up[up.len() - 1]
    }

    /// `up` in turn, each as often as its weight.
    fn round_robin(&self, up: &[usize]) -> usize {
        self.weighted(up, self.turn.fetch_add(1, Ordering::AcqRel))
    }

    /// The target of `up` whose weighted score for `hash` is highest (rendezvous hashing): a
    /// lost target's callers move, and no one else's.
    fn by_hash(&self, up: &[usize], hash: u64) -> usize {
        let score = |i: usize| {
            let t = &self.list[i];
            let h = fnv(hash, t.label.as_bytes());
            // A uniform number in (0, 1]; -w / ln(u) keeps each target's share to its weight.
            let u = ((h >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            -f64::from(t.weight) / u.ln()
        };
        let mut best = up[0];
        let mut best_score = score(best);
        for &i in &up[1..] {
            let s = score(i);
            if s > best_score {
                (best, best_score) = (i, s);
            }
        }
        best
    }

    /// Counts a request towards the retry budget; only an upstream of several targets retries.
    pub fn count_request(&self) {
        if self.several() {
            self.budget.request();
        }
    }

    /// Whether a retry for `why` may go: within the attempts and, but for a connection that
    /// was never made (which costs the targets nothing), within the budget.
    pub fn may_retry(&self, why: RetryWhy, retries_so_far: u32) -> bool {
        if retries_so_far >= self.retries.attempts {
            return false;
        }
        if why != RetryWhy::ConnectFailure && !self.budget.take(self.retries.budget_percent) {
            self.budget_exhausted.inc();
            return false;
        }
        self.retried[why as usize].inc();
        true
    }

    /// An attempt on target `i` begins: it counts as in flight until the guard drops. `None`
    /// when the target filled up since it was picked (another request took its last place).
    pub fn begin(&self, i: usize) -> Option<InFlight<'_>> {
        let t = &self.list[i];
        let n = &t.state.in_flight;
        if t.cap == u32::MAX {
            n.fetch_add(1, Ordering::AcqRel);
        } else {
            n.fetch_update(Ordering::AcqRel, Ordering::Acquire, |k| {
                (k < t.cap).then_some(k + 1)
            })
            .ok()?;
        }
        Some(InFlight { targets: self, i })
    }

    /// An attempt on target `i` begins even past its cap: only when every target is full, which
    /// the upstream's place (the sum of theirs) rules out but for a race.
    pub fn begin_anyway(&self, i: usize) -> InFlight<'_> {
        self.list[i].state.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight { targets: self, i }
    }

    /// The upstream's cap on requests in flight that its targets make: the sum of theirs, when
    /// every one has one.
    pub fn cap_sum(&self) -> Option<u32> {
        self.list.iter().try_fold(0u32, |sum, t| {
            (t.cap != u32::MAX).then(|| sum.saturating_add(t.cap))
        })
    }

    /// Records how an attempt on target `i` ended, ejecting it after too many failures.
    pub fn record(&self, i: usize, outcome: Outcome, why: impl FnOnce() -> String) {
        let t = &self.list[i];
        let s = &t.state;
        s.counts[outcome as usize].inc();
        if outcome == Outcome::Timeout {
            // Slow is not dead: the adaptive limit hears of it, ejection does not, either way.
            return;
        }
        if !outcome.failed() {
            if s.failures.load(Ordering::Relaxed) != 0 {
                s.failures.store(0, Ordering::Release);
            }
            // Read before it is written: nearly every answer finds no probation to end, and a
            // swap would write the line every request.
            if s.probation.load(Ordering::Acquire) && s.probation.swap(false, Ordering::AcqRel) {
                s.ejections.store(0, Ordering::Release);
            }
            return;
        }
        let now = now_ms();
        *s.last_failure.lock().unwrap_or_else(PoisonError::into_inner) = Some((now, why()));
        if !self.several() {
            return;
        }
        let n = s.failures.fetch_add(1, Ordering::AcqRel) + 1;
        let on_probation = s.probation.load(Ordering::Acquire);
        if n < self.eject.consecutive_failures && !on_probation {
            return;
        }
        if s.ejected_until.load(Ordering::Acquire) > now || !self.room_to_eject(now) {
            return;
        }
        let length = ejection_length(self.eject.first, s.ejections.fetch_add(1, Ordering::AcqRel));
        s.ejected_until
            .store(now + length.as_millis() as u64, Ordering::Release);
        s.failures.store(0, Ordering::Release);
        s.probation.store(true, Ordering::Release);
        s.ejected_total.inc();
        s.up.set(0);
        tracing::warn!(target = %t.label, for_ms = length.as_millis() as u64, failures = n, "upstream target ejected");
    }

    /// Whether one more target may be ejected: at most `max_percent` of them are out at once.
    fn room_to_eject(&self, now: u64) -> bool {
        let out = self
            .list
            .iter()
            .filter(|t| t.state.ejected_until.load(Ordering::Acquire) > now)
            .count();
        (out + 1) * 100 <= self.eject.max_percent as usize * self.list.len()
    }

    /// Each target as the admin API shows it.
    pub fn view(&self) -> Vec<serde_json::Value> {
        let now = now_ms();
        self.list
            .iter()
            .map(|t| {
                let s = &t.state;
                let until = s.ejected_until.load(Ordering::Acquire);
                let last = s.last_failure.lock().unwrap_or_else(PoisonError::into_inner).clone();
                serde_json::json!({
                    "target": &*t.label,
                    "name": t.name.as_deref(),
                    "max_in_flight": (t.cap != u32::MAX).then_some(t.cap),
                    "weight": t.weight,
                    "state": if !s.healthy.load(Ordering::Acquire) { "unhealthy" } else if until > now { "ejected" } else if s.probation.load(Ordering::Acquire) { "probation" } else { "up" },
                    "ejected_for_ms": until.saturating_sub(now),
                    "in_flight": s.in_flight.load(Ordering::Acquire),
                    "ejections": s.ejected_total.get(),
                    "last_failure": last.map(|(at, why)| serde_json::json!({
                        "ms_ago": now.saturating_sub(at), "why": why,
                    })),
                })
            })
            .collect()
    }

    /// Marks targets whose ejection ended as up again in the metrics.
    pub fn refresh(&self) {
        let now = now_ms();
        for t in &self.list {
            if t.state.usable(now) && t.state.up.get() == 0 {
                t.state.up.set(1);
            }
        }
    }

    /// Starts the active health checks that are due, each on a task of its own.
    pub fn check_due(&self, health: &Health, host: &http::HeaderValue) {
        let now = now_ms();
        for t in &self.list {
            let s = &t.state;
            if s.next_check.load(Ordering::Acquire) > now || s.checking.swap(true, Ordering::AcqRel) {
                continue;
            }
            s.next_check
                .store(now + health.interval.as_millis() as u64, Ordering::Release);
            let (pool, state, label) = (t.pool.clone(), s.clone(), t.label.clone());
            let (health, host) = (health.clone(), host.clone());
            tokio::spawn(async move {
                let passed = check(&pool, &health, &host).await;
                state.checked(&label, &health, passed);
                state.checking.store(false, Ordering::Release);
            });
        }
    }
}

/// One active health check: a GET of the check's path on a new connection; any 2xx within
/// the timeout passes, and anything else says why not.
async fn check(pool: &ConnPool, health: &Health, host: &http::HeaderValue) -> Result<(), String> {
    use tokio::io::AsyncReadExt;
    let asked = async {
        let mut conn = pool.connect().await.map_err(|e| e.to_string())?;
        let head = format!(
            "GET {} HTTP/1.1\r\nhost: {}\r\nuser-agent: tollgate-health\r\nconnection: close\r\n\r\n",
            health.path,
            host.to_str().unwrap_or_default()
        );
        conn.io.send(head.as_bytes()).await.map_err(|e| e.to_string())?;
        // The head is judged as any answer's is; the body is never read.
        let mut buf = bytes::BytesMut::with_capacity(1024);
        loop {
            match tollgate_http1::response::parse(&buf, Default::default(), |h| h.status) {
                Ok(Parsed::Final(_, status)) if (200..300).contains(&status) => return Ok(()),
                Ok(Parsed::Final(_, status)) => return Err(format!("answered {status}")),
                Ok(Parsed::Interim(n)) => bytes::Buf::advance(&mut buf, n),
                Ok(Parsed::Partial) => {}
                Err(why) => return Err(format!("answered what can't be read: {why}")),
            }
            match conn.io.read_buf(&mut buf).await {
                Ok(0) => return Err("closed before answering".to_string()),
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    };
    match tokio::time::timeout(health.timeout, asked).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {} ms", health.timeout.as_millis())),
    }
}

impl Target {
    /// Whether another request may go to it under its own cap.
    fn room(&self) -> bool {
        self.cap == u32::MAX || self.state.in_flight.load(Ordering::Acquire) < self.cap
    }
}

impl TargetState {
    /// Whether requests may go to it: healthy, and not ejected at `now`.
    fn usable(&self, now: u64) -> bool {
        self.healthy.load(Ordering::Acquire) && self.ejected_until.load(Ordering::Acquire) <= now
    }

    /// A health check's result: `unhealthy_after` failures in a row take a healthy target out;
    /// `healthy_after` passes in a row bring back one that is out, unhealthy or ejected (an
    /// ejection lifted so is on probation).
    fn checked(&self, label: &str, health: &Health, passed: Result<(), String>) {
        let now = now_ms();
        let healthy = self.healthy.load(Ordering::Acquire);
        match passed {
            Ok(()) => {
                self.checks_failed.store(0, Ordering::Release);
                let n = self.checks_passed.fetch_add(1, Ordering::AcqRel) + 1;
                let out = !healthy || self.ejected_until.load(Ordering::Acquire) > now;
                if out && n >= health.healthy_after {
                    self.checks_passed.store(0, Ordering::Release);
                    self.healthy.store(true, Ordering::Release);
                    if self.ejected_until.swap(0, Ordering::AcqRel) > now {
                        self.probation.store(true, Ordering::Release);
                    }
                    self.up.set(1);
                    tracing::info!(target = label, "upstream target passed its health checks");
                }
            }
            Err(why) => {
                self.checks_passed.store(0, Ordering::Release);
                let n = self.checks_failed.fetch_add(1, Ordering::AcqRel) + 1;
                if healthy && n >= health.unhealthy_after {
                    self.checks_failed.store(0, Ordering::Release);
                    self.healthy.store(false, Ordering::Release);
                    self.up.set(0);
                    tracing::warn!(target = label, %why, "upstream target failed its health checks");
                    *self.last_failure.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some((now, format!("health check: {why}")));
                }
            }
        }
    }

    fn new(upstream: &Arc<str>, target: &Arc<str>, metrics: &Metrics) -> TargetState {
        let label = TargetLabel {
            upstream: upstream.clone(),
            target: target.clone(),
        };
        let counts = [
            Outcome::Ok,
            Outcome::ErrorStatus,
            Outcome::ConnectFailure,
            Outcome::Reset,
            Outcome::Timeout,
        ]
        .map(|o| {
            metrics
                .upstream_requests
                .get_or_create(&TargetOutcome {
                    upstream: upstream.clone(),
                    target: target.clone(),
                    outcome: o.label(),
                })
                .clone()
        });
        let up = metrics.upstream_target_up.get_or_create(&label).clone();
        up.set(1);
        TargetState {
            in_flight: AtomicU32::new(0),
            failures: AtomicU32::new(0),
            ejected_until: AtomicU64::new(0),
            ejections: AtomicU32::new(0),
            probation: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            checks_passed: AtomicU32::new(0),
            checks_failed: AtomicU32::new(0),
            next_check: AtomicU64::new(0),
            checking: AtomicBool::new(false),
            last_failure: Mutex::new(None),
            counts,
            up,
            ejected_total: metrics.upstream_ejections.get_or_create(&label).clone(),
        }
    }
}

/// An attempt in flight on a target, counted for least-request until it drops.
pub(crate) struct InFlight<'a> {
    targets: &'a Targets,
    i: usize,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.targets.list[self.i]
            .state
            .in_flight
            .fetch_sub(1, Ordering::AcqRel);
    }
}

/// One target as an address.
struct Member {
    authority: Authority,
    name: Option<Arc<str>>,
    weight: u32,
    cap: Option<u32>,
}

/// `u`'s targets as addresses: each named one once per address `names` knows for it (all
/// with its weight and cap), or as named while its name is not resolved yet; an address
/// reached twice is one target with both weights and both caps.
fn members(u: &Upstream, names: &Names) -> Vec<Member> {
    let default_port = if u.tls.is_some() { 443 } else { 80 };
    let mut out: Vec<Member> = Vec::with_capacity(u.targets.len());
    let mut add = |authority: Authority, name: Option<Arc<str>>, t: &tollgate_rules::Target| match out
        .iter_mut()
        .find(|m| m.authority == authority)
    {
        Some(m) => {
            m.weight = m.weight.saturating_add(t.weight);
            m.cap = match (m.cap, t.max_in_flight) {
                (Some(a), Some(b)) => Some(a.saturating_add(b)),
                _ => None,
            };
        }
        None => out.push(Member {
            authority,
            name,
            weight: t.weight,
            cap: t.max_in_flight,
        }),
    };
    for t in &u.targets {
        let host = t.authority.host().trim_start_matches('[').trim_end_matches(']');
        let addrs = match host.parse::<std::net::IpAddr>() {
            Ok(_) => None,
            Err(_) => names.addresses(host),
        };
        let Some(addrs) = addrs else {
            add(t.authority.clone(), None, t);
            continue;
        };
        let name: Arc<str> = t.authority.as_str().into();
        let port = t.authority.port_u16().unwrap_or(default_port);
        for ip in addrs {
            let Ok(authority) = std::net::SocketAddr::new(ip, port)
                .to_string()
                .parse::<Authority>()
            else {
                continue;
            };
            add(authority, Some(name.clone()), t);
        }
    }
    out
}

/// FNV-1a of `bytes` after `seed`'s: the caller's hash mixed with a target's name.
fn fnv(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for &b in seed.to_le_bytes().iter().chain(bytes) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // A final mix: FNV's low bits are weak, and the score reads the high ones.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

/// The hash `"balance": "hash"` keeps a caller to: its key id, or its address without one.
pub(crate) fn caller_hash(bytes: &[u8]) -> u64 {
    fnv(0, bytes)
}

/// How long a target stays out after its `k`-th ejection in a row (from 0).
fn ejection_length(first: Duration, k: u32) -> Duration {
    first.saturating_mul(1 << k.min(16)).min(MAX_EJECTION)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(targets: &[(&str, u32)], balance: Balance) -> Arc<tollgate_rules::Snapshot> {
        let mut rules = serde_json::json!({
            "version": 1,
            "upstreams": {"u": {"targets": targets.iter().map(|(u, w)| serde_json::json!({"url": format!("http://{u}"), "weight": w})).collect::<Vec<_>>(),
                "balance": match balance { Balance::LeastRequest => "least_request", Balance::RoundRobin => "round_robin", Balance::Hash => "hash" }}},
            "limits": {},
            "routes": [{"method": "GET", "path": "/v1", "upstream": "u"}]
        });
        rules["upstreams"]["u"]["eject"] = serde_json::json!({"consecutive_failures": 2, "for_ms": 1000});
        Arc::new(
            tollgate_rules::compile(rules.to_string().as_bytes(), "r.json", Default::default())
                .unwrap_or_else(|e| panic!("{e}")),
        )
    }

    #[tokio::test]
    async fn round_robin_follows_the_weights() {
        let m = Metrics::new();
        let t = Targets::new(
            &upstream(&[("a:1", 2), ("b:1", 1)], Balance::RoundRobin).upstreams[0],
            None,
            &m,
            &Names::system(),
        );
        let mut seen = [0; 2];
        for _ in 0..300 {
            seen[t.pick(Picking::default(), &[]).unwrap()] += 1;
        }
        assert_eq!(seen, [200, 100]);
    }

    #[tokio::test]
    async fn a_hash_keeps_a_caller_and_a_lost_target_moves_only_its_own() {
        let m = Metrics::new();
        let t = Targets::new(
            &upstream(&[("a:1", 1), ("b:1", 1), ("c:1", 1)], Balance::Hash).upstreams[0],
            None,
            &m,
            &Names::system(),
        );
        let callers: Vec<u64> = (0..300)
            .map(|k| caller_hash(format!("k-{k}").as_bytes()))
            .collect();
        let before: Vec<usize> = callers
            .iter()
            .map(|&hash| t.pick(Picking { hash }, &[]).unwrap())
            .collect();
        for c in 0..3 {
            let n = before.iter().filter(|&&b| b == c).count();
            assert!((60..=140).contains(&n), "target {c} has {n} of 300 callers");
        }
        // Target 1 tried (as if lost): only its callers move.
        for (k, &hash) in callers.iter().enumerate() {
            let after = t.pick(Picking { hash }, &[1]).unwrap();
            if before[k] != 1 {
                assert_eq!(after, before[k], "caller {k} moved");
            }
        }
    }

    #[tokio::test]
    async fn failures_eject_with_doubling_and_never_past_the_share_or_into_an_empty_pool() {
        let m = Metrics::new();
        let t = Targets::new(
            &upstream(&[("a:1", 1), ("b:1", 1), ("c:1", 1)], Balance::LeastRequest).upstreams[0],
            None,
            &m,
            &Names::system(),
        );
        t.record(0, Outcome::ConnectFailure, || "refused".into());
        assert!((0..50).all(|_| t.pick(Picking::default(), &[]).is_some()));
        // A timeout between two failures neither ejects nor starts the count again.
        t.record(0, Outcome::Timeout, || "slow".into());
        assert!((0..50).any(|_| t.pick(Picking::default(), &[]) == Some(0)));
        t.record(0, Outcome::ConnectFailure, || "refused".into());
        // Ejected: never chosen while another is up.
        assert!((0..200).all(|_| t.pick(Picking::default(), &[]) != Some(0)));
        // A second target may not go too: two of three is over half.
        t.record(1, Outcome::Reset, || "reset".into());
        t.record(1, Outcome::Reset, || "reset".into());
        assert!((0..200).any(|_| t.pick(Picking::default(), &[]) == Some(1)));
        // Every untried target ejected or tried: panic mode still answers.
        assert_eq!(t.pick(Picking::default(), &[1, 2]), Some(0));
        assert_eq!(t.pick(Picking::default(), &[0, 1, 2]), None);
        assert_eq!(
            ejection_length(Duration::from_secs(30), 0),
            Duration::from_secs(30)
        );
        assert_eq!(
            ejection_length(Duration::from_secs(30), 2),
            Duration::from_secs(120)
        );
        assert_eq!(ejection_length(Duration::from_secs(30), 9), MAX_EJECTION);
    }

    #[tokio::test]
    async fn retries_stay_within_the_budget() {
        let m = Metrics::new();
        let t = Targets::new(
            &upstream(&[("a:1", 1), ("b:1", 1)], Balance::LeastRequest).upstreams[0],
            None,
            &m,
            &Names::system(),
        );
        for _ in 0..1000 {
            t.count_request();
        }
        let taken = (0..1000)
            .filter(|_| t.may_retry(RetryWhy::ErrorStatus, 0))
            .count();
        assert_eq!(taken, 200, "20% of 1000 requests");
        assert!(
            t.may_retry(RetryWhy::ConnectFailure, 0),
            "a connection never made costs nothing"
        );
        assert!(
            !t.may_retry(RetryWhy::ConnectFailure, 2),
            "but the attempts still bound it"
        );
        assert_eq!(m.upstream_retry_budget_exhausted.get(), 800);
    }
}
