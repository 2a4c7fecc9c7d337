//! The consumer loop of `tollgate meter`: add up new records, report identities that fell
//! silent without an `end` record, keep the lag gauge, and set each quota key's flag; once
//! (`--once`) or every poll until stopped.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use tollgate_rules::{CompileOptions, Snapshot};

use crate::flags::{Flag, State};
use crate::ledger::Ledger;
use crate::ledger_types::{Calendar, PassReport, PeriodLabel};
use crate::metrics::MeterMetrics;

/// Passes per tick while records keep coming, so a long backlog still gets its flags and lag
/// set as it goes.
const MAX_PASSES_PER_TICK: usize = 20;

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub once: bool,
    pub silence: Duration,
    pub batch: usize,
    pub poll: Duration,
}

/// The rules file, read again when it changes: a key added to the rules gets its zone and
/// flag without a restart.
pub struct RulesFile {
    pub path: PathBuf,
    modified: Option<SystemTime>,
    pub snap: Snapshot,
}

impl RulesFile {
    pub fn load(path: PathBuf) -> Result<RulesFile, String> {
        let modified = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
        let snap =
            tollgate_rules::load(&path, CompileOptions::default()).map_err(|e| format!("--rules {e}"))?;
        Ok(RulesFile { path, modified, snap })
    }

    /// Whether new rules were loaded; rules that no longer compile are logged and the ones
    /// loaded before stay.
    fn reload_if_changed(&mut self) -> bool {
        let modified = std::fs::metadata(&self.path).and_then(|m| m.modified()).ok();
        if modified == self.modified {
            return false;
        }
        self.modified = modified;
        match tollgate_rules::load(&self.path, CompileOptions::default()) {
            Ok(snap) => {
                tracing::info!(rules = %self.path.display(), version = snap.version, "rules reloaded");
                self.snap = snap;
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "rules changed but can't be used; keeping the rules loaded before");
                false
            }
        }
    }
}

fn log_pass(r: &PassReport, metrics: &MeterMetrics) {
    for m in &r.malformed {
        tracing::warn!(entry = %m.id, reason = %m.reason, "malformed usage record: skipped and marked done");
    }
    for id in &r.resumed {
        tracing::info!(
            gateway = %id.gateway, boot = %id.boot,
            "identity {id}, reported as an unclean end, is sending records again: it was only idle"
        );
    }
    for id in &r.ended_after_report {
        tracing::info!(
            gateway = %id.gateway, boot = %id.boot,
            "identity {id}, reported as an unclean end, sent its end record: no longer counted unclean"
        );
    }
    metrics.count("raised", r.raised);
    metrics.count("repeat", r.repeats);
    metrics.count("end", r.ends);
    metrics.count("malformed", r.malformed.len());
    if r.read > 0 {
        tracing::debug!(
            read = r.read,
            raised = r.raised,
            added = r.added,
            repeats = r.repeats,
            ends = r.ends,
            malformed = r.malformed.len(),
            newest_ms = ?r.newest_ms,
            "usage records added up"
        );
    }
}

struct Consumer<'a> {
    ledger: &'a mut Ledger,
    rules: RulesFile,
    calendar: Calendar,
    opts: RunOptions,
    metrics: &'a MeterMetrics,
    /// Each quota key's state as last set by this process, to log only changes.
    states: HashMap<String, (String, State)>,
}

impl Consumer<'_> {
    /// Adds up what is there; returns how many records were read.
    async fn catch_up(&mut self) -> Result<usize, String> {
        let mut read = 0;
        let mut passes = 0;
        loop {
            let r = self.ledger.pass(self.opts.batch, &mut self.calendar).await?;
            log_pass(&r, self.metrics);
            read += r.read;
            passes += 1;
            if r.read == 0 || (!self.opts.once && passes >= MAX_PASSES_PER_TICK) {
                return Ok(read);
            }
        }
    }

    async fn report_silent(&mut self, now: i64) -> Result<(), String> {
        let oldest = self.ledger.oldest_pending_ms().await?;
        let lag_ms = oldest.map_or(0, |o| (now - o).max(0));
        self.metrics.lag_seconds.set(lag_ms as f64 / 1000.0);
        // A record not yet added up may be the identity's next one, or its end: judge silence
        // only up to the oldest of those.
        let horizon = oldest.map_or(now, |o| o.min(now));
        let before = horizon.saturating_sub(self.opts.silence.as_millis() as i64);
        for (id, last_ms) in self.ledger.take_silent(before).await? {
            self.metrics.unclean_ends.inc();
            tracing::warn!(
                gateway = %id.gateway,
                boot = %id.boot,
                last_record_ms = last_ms,
                "unclean end: gateway identity {id} fell silent without an end record; usage it admitted \
                 after its last flush is missing (an under-bill)"
            );
        }
        Ok(())
    }

    async fn set_flags(&mut self, now: i64) -> Result<(), String> {
        let snap = &self.rules.snap;
        let quota_keys: Vec<_> = snap
            .keys
            .iter()
            .filter_map(|k| k.quota.as_ref().map(|q| (&*k.id, q)))
            .collect();
        let ids: Vec<&str> = quota_keys.iter().map(|(id, _)| *id).collect();
        let lasts = self.ledger.key_last_ms(&ids).await?;
        for ((id, quota), last) in quota_keys.iter().zip(lasts) {
            // The period of the key's newest record: gateways ignore a flag past its reset
            // (`Flag::in_force`), so a key idle since an earlier period is not held to it.
            let period = quota.period(last.unwrap_or(now));
            let label = PeriodLabel {
                per: quota.per,
                label: period.label.clone(),
            };
            let used = self.ledger.usage(&label, id).await?.admitted;
            let flag = Flag {
                state: State::of(used, quota.limit),
                quota: quota.per,
                period: period.label,
                used,
                limit: quota.limit,
                resets_at_ms: period.resets_at_ms,
                resets_at: period.resets_at,
            };
            if !self.ledger.set_flag(id, &flag).await? {
                continue;
            }
            let now_state = (flag.period.clone(), flag.state);
            if self.states.get(*id) != Some(&now_state) && flag.state != State::Under {
                tracing::info!(
                    key = %id, period = %flag.period, used, limit = quota.limit,
                    "key {id} is {} its {} quota", if flag.state == State::Over { "over" } else { "near" },
                    quota.per.as_str()
                );
            }
            self.states.insert(id.to_string(), now_state);
        }
        let keep: HashSet<&str> = ids.into_iter().collect();
        for key in self.ledger.drop_flags_except(&keep).await? {
            tracing::info!(key = %key, "flag removed: the key has no quota in the rules");
        }
        Ok(())
    }

    async fn tick(&mut self, first: bool) -> Result<(), String> {
        let mut reloaded = false;
        if !first && self.rules.reload_if_changed() {
            self.calendar = Calendar::new(&self.rules.snap);
            reloaded = true;
        }
        let read = self.catch_up().await?;
        let now = self.ledger.now_ms().await?;
        self.report_silent(now).await?;
        // Flags change only with new totals or new rules; another consumer sets those it adds.
        if first || reloaded || read > 0 {
            self.set_flags(now).await?;
        }
        Ok(())
    }
}

/// Runs until `stop` resolves (or once); in a long run a failed tick is logged and tried
/// again at the next poll, since the store may come back.
pub async fn run(
    ledger: &mut Ledger,
    rules: RulesFile,
    opts: RunOptions,
    metrics: &MeterMetrics,
    stop: impl Future<Output = ()>,
) -> Result<(), String> {
    let calendar = Calendar::new(&rules.snap);
    let mut c = Consumer {
        ledger,
        rules,
        calendar,
        opts,
        metrics,
        states: HashMap::new(),
    };
    tokio::pin!(stop);
    let mut first = true;
    loop {
        match c.tick(first).await {
            Ok(()) => first = false,
            Err(e) if c.opts.once => return Err(e),
            Err(e) => tracing::error!(error = %e, "metering pass failed; trying again"),
        }
        if c.opts.once {
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(c.opts.poll) => {}
            _ = &mut stop => return Ok(()),
        }
    }
}
