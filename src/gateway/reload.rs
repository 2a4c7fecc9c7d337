//! Live rules: a reload compiles a new snapshot and swaps it in only when its version is above
//! the running one. The file is watched through its parent directory (editors replace files by
//! rename), events are filtered by file name and debounced; SIGHUP reloads too.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use tollgate_rules::{RulesError, RulesLoader, RulesSource, Snapshot};
use tollgate_telemetry::metrics::Metrics;

/// What one reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    /// The new rules run now.
    Swapped { from: u64, to: u64 },
    /// The file's version was not above the running one; nothing changed.
    Ignored { offered: u64, running: u64 },
    /// The file is invalid; the running rules stay.
    Failed(RulesError),
}

pub struct Reloader {
    loader: RulesLoader,
    rules: Arc<ArcSwap<Snapshot>>,
    metrics: Arc<Metrics>,
    /// Serializes reloads so "compare the version, then swap" is one step.
    lock: Mutex<()>,
    /// The last reload that left the running rules in place, and why.
    rejected: Mutex<Option<Rejected>>,
}

/// A reload that changed nothing: when, and why.
#[derive(Debug, Clone)]
pub struct Rejected {
    pub at: std::time::SystemTime,
    pub why: String,
}

impl Reloader {
    pub fn new(loader: RulesLoader, rules: Arc<ArcSwap<Snapshot>>, metrics: Arc<Metrics>) -> Reloader {
        metrics.rules_version.set(rules.load().version as i64);
        Reloader {
            loader,
            rules,
            metrics,
            lock: Mutex::new(()),
            rejected: Mutex::new(None),
        }
    }

    /// The last reload that left the running rules in place.
    pub fn last_rejected(&self) -> Option<Rejected> {
        self.rejected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Reads, validates and compiles the rules, and swaps them in if their version is higher.
    pub fn reload(&self) -> Reload {
        let _one_at_a_time = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let running = self.rules.load().version;
        let outcome = match self.loader.load() {
            Err(e) => Reload::Failed(e),
            Ok(snap) if snap.version <= running => Reload::Ignored {
                offered: snap.version,
                running,
            },
            Ok(snap) => {
                let to = snap.version;
                self.rules.store(Arc::new(snap));
                Reload::Swapped { from: running, to }
            }
        };
        let why = match &outcome {
            Reload::Swapped { .. } => None,
            Reload::Ignored { offered, running } => Some(format!(
                "version {offered} is not above the running version {running}"
            )),
            Reload::Failed(e) => Some(e.to_string()),
        };
        if let Some(why) = why {
            *self.rejected.lock().unwrap_or_else(PoisonError::into_inner) = Some(Rejected {
                at: std::time::SystemTime::now(),
                why,
            });
        }
        match &outcome {
            Reload::Swapped { from, to } => {
                self.metrics.reload("ok");
                self.metrics.rules_version.set(*to as i64);
                tracing::info!(from, to, "rules reloaded");
            }
            Reload::Ignored { offered, running } => {
                self.metrics.reload("ignored");
                tracing::warn!(
                    offered,
                    running,
                    "rules reload ignored: version {offered} is not above the running version {running}"
                );
            }
            Reload::Failed(e) => {
                self.metrics.reload("failed");
                tracing::error!(file = %e.file, field = %e.field, reason = %e.reason, "rules reload failed; keeping version {running}");
            }
        }
        outcome
    }

    /// Watches the rules file (if it is a file) and SIGHUP, reloading on each, until the
    /// returned handle is dropped.
    pub fn watch(self: &Arc<Self>, debounce: Duration) -> Result<WatchHandle, String> {
        let (tx, mut rx) = mpsc::channel::<()>(1);
        let watcher = match &self.loader.source {
            RulesSource::File(path) => Some(watch_file(path, tx.clone())?),
            RulesSource::Embedded { .. } => None,
        };
        let hup_tx = tx.clone();
        let hup = tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let Ok(mut hup) = signal(SignalKind::hangup()) else {
                tracing::warn!("cannot listen for SIGHUP; reload by editing the file");
                return;
            };
            while hup.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading rules");
                let _ = hup_tx.try_send(());
            }
        });
        let me = self.clone();
        let task = tokio::spawn(async move {
            while rx.recv().await.is_some() {
                // Wait for the writes to settle: a save is often several events.
                while let Ok(Some(())) = tokio::time::timeout(debounce, rx.recv()).await {}
                let me = me.clone();
                let _ = tokio::task::spawn_blocking(move || me.reload()).await;
            }
        });
        Ok(WatchHandle {
            _watcher: watcher,
            tasks: vec![task, hup],
        })
    }
}

fn watch_file(path: &Path, tx: mpsc::Sender<()>) -> Result<notify::RecommendedWatcher, String> {
    let name = path
        .file_name()
        .ok_or_else(|| format!("{}: not a file path", path.display()))?
        .to_owned();
    let dir: PathBuf = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        if event.kind.is_access() {
            return;
        }
        if event
            .paths
            .iter()
            .any(|p| p.file_name() == Some(name.as_os_str()))
        {
            // A full channel already holds a pending reload: this event is covered.
            let _ = tx.try_send(());
        }
    })
    .map_err(|e| format!("{}: cannot watch: {e}", dir.display()))?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(|e| format!("{}: cannot watch: {e}", dir.display()))?;
    Ok(watcher)
}

/// Keeps the watcher alive; dropping it stops watching.
pub struct WatchHandle {
    _watcher: Option<notify::RecommendedWatcher>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for WatchHandle {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
