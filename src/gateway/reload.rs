//! Live rules: a reload compiles a new snapshot and swaps it in only when its version is above
//! the running one. The file is watched wherever its path leads: the directory of the path as
//! given, of each symlink on the way and of the file it resolves to, so a rename over the file
//! (editors, `mv`), a write in place and a swapped symlink (a Kubernetes ConfigMap's `..data`)
//! are all seen. Events are filtered by those names and debounced, and the path is resolved
//! again on each; SIGHUP reloads too.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tollgate_store::redis::Credentials;

use arc_swap::ArcSwap;
use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use tollgate_rules::{ManagedKey, RulesError, RulesLoader, RulesSource, Snapshot};
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
    /// The store's password file, read again on SIGHUP with the rules.
    store_credentials: Option<Arc<Credentials>>,
}

/// Why a set of keys made through the admin API was not put in place; the running rules stay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeysRefused {
    /// One of the keys can't be compiled beside the file's: its field is `managed_keys[i]…`.
    Key(RulesError),
    /// The rules file no longer loads.
    File(RulesError),
    /// The file on disk changed to a version not above the running one; a key change must not
    /// roll the rules back, so it waits for the file to be fixed.
    FileChanged { offered: u64, running: u64 },
}

/// A failed load with keys in it: the keys' fault when the error names one of them.
fn refused(e: RulesError) -> KeysRefused {
    if e.field.starts_with("managed_keys") {
        KeysRefused::Key(e)
    } else {
        KeysRefused::File(e)
    }
}

impl std::fmt::Display for KeysRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeysRefused::Key(e) | KeysRefused::File(e) => e.fmt(f),
            KeysRefused::FileChanged { offered, running } => write!(
                f,
                "the rules file changed to version {offered}, not above the running {running}: fix it before changing keys"
            ),
        }
    }
}

/// A reload that changed nothing: when, and why.
#[derive(Debug, Clone)]
pub(crate) struct Rejected {
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
            store_credentials: None,
        }
    }

    /// Reads the store's password file again on each SIGHUP, so a rotated password needs no
    /// restart: the connections open stay, and the next one authenticates with the new one.
    pub fn with_store_credentials(mut self, credentials: Option<Arc<Credentials>>) -> Reloader {
        self.store_credentials = credentials;
        self
    }

    /// The keys made through the admin API that are in place now, compiled after the file's
    /// on every load. The running snapshot holds them, compiled, and is their only copy: held
    /// a second time as the compiler takes them, they cost more than the compiled keys do.
    pub(crate) fn managed(&self) -> Vec<ManagedKey> {
        self.rules.load().managed_keys()
    }

    /// Whether `keys` would compile beside the running rules' file, without putting them in
    /// place: what the admin API asks before it stores a change.
    pub fn check_managed(&self, keys: &[ManagedKey]) -> Result<(), KeysRefused> {
        self.loader.load_with(keys).map(drop).map_err(refused)
    }

    /// Puts `keys`, the whole set made through the admin API, in place beside the rules file:
    /// both compile into a snapshot that replaces the running one. The file is read again; if
    /// it changed to a higher version, that reload happens here too.
    pub fn set_managed(&self, keys: &[ManagedKey]) -> Result<(), KeysRefused> {
        let _one_at_a_time = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let running = self.rules.load_full();
        let snap = self.loader.load_with(keys).map_err(refused)?;
        if snap.digest != running.digest && snap.version <= running.version {
            return Err(KeysRefused::FileChanged {
                offered: snap.version,
                running: running.version,
            });
        }
        if snap.version != running.version {
            self.metrics.reload("ok");
            self.metrics.rules_version.set(snap.version as i64);
            tracing::info!(from = running.version, to = snap.version, "rules reloaded");
        }
        self.rules.store(Arc::new(snap));
        Ok(())
    }

    /// The last reload that left the running rules in place.
    pub(crate) fn last_rejected(&self) -> Option<Rejected> {
        self.rejected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Reads, validates and compiles the rules, and swaps them in if their version is higher.
    pub fn reload(&self) -> Reload {
        let _one_at_a_time = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let running = self.rules.load().version;
        let outcome = match self.loader.load_with(&self.managed()) {
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
    pub(crate) fn watch(self: &Arc<Self>, debounce: Duration) -> Result<WatchHandle, String> {
        let (tx, mut rx) = mpsc::channel::<()>(1);
        let watch = match &self.loader.source {
            RulesSource::File(path) => Some(Arc::new(Mutex::new(PathWatch::new(path, tx.clone())?))),
            RulesSource::Embedded { .. } => None,
        };
        let hup_tx = tx.clone();
        let credentials = self.store_credentials.clone();
        let hup = tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let Ok(mut hup) = signal(SignalKind::hangup()) else {
                tracing::warn!("cannot listen for SIGHUP; reload by editing the file");
                return;
            };
            while hup.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading rules");
                let _ = hup_tx.try_send(());
                match credentials.as_deref().map(Credentials::reload) {
                    None | Some(Ok(false)) => {}
                    Some(Ok(true)) => {
                        tracing::info!("SIGHUP: the store's password file changed; new connections use it")
                    }
                    Some(Err(e)) => {
                        tracing::error!(error = %e, "SIGHUP: the store's password file did not read; keeping the password in use")
                    }
                }
            }
        });
        let me = self.clone();
        let task = tokio::spawn(async move {
            while rx.recv().await.is_some() {
                // Wait for the writes to settle: a save is often several events.
                while let Ok(Some(())) = tokio::time::timeout(debounce, rx.recv()).await {}
                let me = me.clone();
                let watch = watch.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    // Follow the path before reading it, so a change made after this reload
                    // is watched where the file is now.
                    if let Some(w) = &watch {
                        w.lock().unwrap_or_else(PoisonError::into_inner).follow();
                    }
                    me.reload()
                })
                .await;
            }
        });
        Ok(WatchHandle {
            tasks: vec![task, hup],
        })
    }
}

/// Names that matter, by the directory that holds them.
type Names = BTreeMap<PathBuf, BTreeSet<OsString>>;

/// The directories a rules path depends on, and in each the names whose change may change what
/// the path reads: each symlink on the way and the file it ends at. A ConfigMap's
/// `rules.json -> ..data/rules.json`, `..data -> ..2026_12_01_v1` gives `rules.json` and
/// `..data` in the mounted directory and `rules.json` in `..2026_12_01_v1`.
///
/// A component that can't be read (not there yet) ends nothing: it is named as it stands, so
/// its creation is seen.
fn trace(path: &Path) -> Names {
    // Symlink loops end here; the reload then reports the file as unreadable.
    const MAX_LINKS: usize = 40;
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(path)
    };
    let mut names = Names::new();
    // Components still to walk, the next one last.
    let mut pending: Vec<OsString> = Vec::new();
    push_front(&mut pending, &absolute);
    let mut at = PathBuf::from("/");
    let mut links = 0;
    while let Some(part) = pending.pop() {
        match part.to_str() {
            Some("/") => at = PathBuf::from("/"),
            Some(".") => {}
            Some("..") => {
                at.pop();
            }
            _ => {
                let next = at.join(&part);
                let is_link = std::fs::symlink_metadata(&next).is_ok_and(|m| m.file_type().is_symlink());
                if !is_link || links == MAX_LINKS {
                    if pending.is_empty() {
                        names.entry(at).or_default().insert(part);
                        return names;
                    }
                    at = next;
                    continue;
                }
                links += 1;
                names.entry(at.clone()).or_default().insert(part);
                match std::fs::read_link(&next) {
                    Ok(target) => push_front(&mut pending, &target),
                    Err(_) => at = next,
                }
            }
        }
    }
    names
}

/// Puts `path`'s components before the ones pending (a stack: the next one last).
fn push_front(pending: &mut Vec<OsString>, path: &Path) {
    for c in path.components().rev() {
        pending.push(match c {
            Component::RootDir | Component::Prefix(_) => OsString::from("/"),
            Component::CurDir => OsString::from("."),
            Component::ParentDir => OsString::from(".."),
            Component::Normal(n) => n.to_owned(),
        });
    }
}

/// A watch on every directory [`trace`] names, moved as the path leads elsewhere.
struct PathWatch {
    path: PathBuf,
    watcher: notify::RecommendedWatcher,
    /// Shared with the watcher's callback, which filters events by it.
    names: Arc<Mutex<Names>>,
    /// The directories watched now.
    dirs: BTreeSet<PathBuf>,
}

impl PathWatch {
    fn new(path: &Path, tx: mpsc::Sender<()>) -> Result<PathWatch, String> {
        if path.file_name().is_none() {
            return Err(format!("{}: not a file path", path.display()));
        }
        let names = Arc::new(Mutex::new(Names::new()));
        let filter = names.clone();
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let Ok(event) = event else { return };
            if event.kind.is_access() {
                return;
            }
            let names = filter.lock().unwrap_or_else(PoisonError::into_inner);
            let matters = event.paths.iter().any(|p| match (p.parent(), p.file_name()) {
                (Some(dir), Some(name)) => names.get(dir).is_some_and(|n| n.contains(name)),
                _ => false,
            });
            if matters {
                // A full channel already holds a pending reload: this event is covered.
                let _ = tx.try_send(());
            }
        })
        .map_err(|e| format!("{}: cannot watch: {e}", path.display()))?;
        let mut watch = PathWatch {
            path: path.to_path_buf(),
            watcher,
            names,
            dirs: BTreeSet::new(),
        };
        watch.follow();
        // Later a directory on the way may come and go, but one must be watched from the start.
        if watch.dirs.is_empty() {
            let dir = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            return Err(format!("{}: cannot watch its directory", dir.display()));
        }
        Ok(watch)
    }

    /// Resolves the path again and moves the watches to where it leads now.
    fn follow(&mut self) {
        let names = trace(&self.path);
        for dir in self.dirs.clone() {
            if !names.contains_key(&dir) {
                // The directory may be gone already (a ConfigMap's old version).
                let _ = self.watcher.unwatch(&dir);
                self.dirs.remove(&dir);
            }
        }
        for dir in names.keys() {
            if !self.dirs.contains(dir) {
                match self.watcher.watch(dir, RecursiveMode::NonRecursive) {
                    Ok(()) => {
                        self.dirs.insert(dir.clone());
                    }
                    // Retried at the next event or SIGHUP.
                    Err(e) => {
                        tracing::warn!(dir = %dir.display(), error = %e, "cannot watch a directory of the rules path")
                    }
                }
            }
        }
        *self.names.lock().unwrap_or_else(PoisonError::into_inner) = names;
    }
}

/// Keeps the watcher alive; dropping it stops watching.
pub(crate) struct WatchHandle {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for WatchHandle {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_rules::{CompileOptions, hash_secret};

    fn rules(version: u64, file_key: &str) -> String {
        serde_json::json!({
            "version": version,
            "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
            "limits": {"per_key": {"dimension": "key", "rate": "10/1s", "burst": 10}},
            "routes": [{"method": "GET", "path": "/v1", "upstream": "u", "cost": {"per_key": 1}}],
            "keys": [{"id": file_key, "sha256": hex::encode(hash_secret(file_key.as_bytes()))}]
        })
        .to_string()
    }

    fn managed(id: &str, rate: &str) -> ManagedKey {
        ManagedKey {
            id: id.into(),
            tenant: id.into(),
            name: None,
            limits: vec![("per_key".to_string(), rate.to_string(), 5)],
            secrets: vec![(hash_secret(id.as_bytes()), None)],
            expires_at: None,
            revoked: false,
        }
    }

    #[test]
    fn the_running_snapshot_gives_back_the_keys_it_was_given() {
        let dir = std::env::temp_dir().join(format!("tollgate-reload-back-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rules.json");
        std::fs::write(&path, rules(1, "f-1")).unwrap();
        let loader = RulesLoader {
            source: RulesSource::File(path),
            opts: CompileOptions::default(),
            upstream_override: Vec::new(),
        };
        let snap = Arc::new(ArcSwap::from_pointee(loader.load().unwrap()));
        let r = Reloader::new(loader, snap, Metrics::new());
        let mut rotated = managed("m-1", "5/1s");
        rotated.name = Some("billing".into());
        rotated.tenant = "acme".into();
        rotated.secrets = vec![
            (hash_secret(b"oldest"), Some(1_000)),
            (hash_secret(b"older"), Some(2_000)),
            (hash_secret(b"newest"), None),
        ];
        rotated.expires_at = Some(9_000);
        let mut revoked = managed("m-2", "7/2s");
        revoked.revoked = true;
        let mut same_tenant = managed("m-3", "5/1s");
        same_tenant.tenant = "acme".into();
        let set = vec![rotated, revoked, same_tenant];
        r.set_managed(&set).unwrap();
        assert_eq!(r.managed(), set);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn managed_keys_stay_through_reloads_and_never_roll_the_file_back() {
        let dir = std::env::temp_dir().join(format!("tollgate-reload-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rules.json");
        std::fs::write(&path, rules(1, "f-1")).unwrap();
        let loader = RulesLoader {
            source: RulesSource::File(path.clone()),
            opts: CompileOptions::default(),
            upstream_override: Vec::new(),
        };
        let snap = Arc::new(ArcSwap::from_pointee(loader.load().unwrap()));
        let r = Reloader::new(loader, snap.clone(), Metrics::new());
        let first = snap.load().serial;

        r.set_managed(&[managed("m-1", "5/1s")]).unwrap();
        let now = snap.load_full();
        assert_eq!((now.version, now.keys.len()), (1, 2));
        assert!(now.serial > first, "a key change is a new snapshot");

        let bad = r.set_managed(&[managed("m-1", "5/1s"), managed("m-2", "nonsense")]);
        match bad {
            Err(KeysRefused::Key(e)) => assert_eq!(e.field, "managed_keys[1].limits.per_key.rate", "{e}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(snap.load().keys.len(), 2, "the running keys stay");
        assert!(
            r.check_managed(&[managed("f-1", "5/1s")]).is_err(),
            "an id the file has"
        );

        std::fs::write(&path, rules(2, "f-2")).unwrap();
        assert_eq!(r.reload(), Reload::Swapped { from: 1, to: 2 });
        let now = snap.load_full();
        assert!(now.key_by_id("m-1").is_some() && now.key_by_id("f-2").is_some());

        std::fs::write(&path, rules(1, "f-3")).unwrap();
        assert_eq!(
            r.set_managed(&[]),
            Err(KeysRefused::FileChanged {
                offered: 1,
                running: 2
            })
        );
        assert!(snap.load().key_by_id("m-1").is_some(), "nothing changed");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
