//! Keys with a life cycle: made, rotated, revoked and changed through the admin API, kept in the
//! store's Redis (or a SQLite file on the embedded store), followed by every gateway that
//! shares it, and compiled beside the rules file's keys so a request finds them in memory.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use jiff::Timestamp;
use serde_json::{Value, json};
use tokio::sync::Mutex;

use crate::reload::{KeysRefused, Reloader};
use crate::respond::{ApiError, Body, json_response};
use tollgate_keys::{Create, FieldError, KeyRecord, KeyStore, Patch, Rotate, change};
use tollgate_limit::clock::Clock;
use tollgate_rules::{ManagedKey, Snapshot};
use tollgate_telemetry::metrics::Metrics;

/// The largest body a key change may have: a key is a few hundred bytes.
const MAX_BODY: usize = 64 * 1024;

/// How often a gateway asks its store what changed: a change made on one gateway serves on
/// every other within this and a compile.
pub const FOLLOW_EVERY: Duration = Duration::from_millis(250);

/// The longest a call to the key store may take: a store that isn't there must not hold up
/// the gateway's start, the follower or an admin request.
const STORE_TIMEOUT: Duration = Duration::from_secs(2);

/// `f`, or an error saying the key store did not answer in [`STORE_TIMEOUT`].
async fn within<T>(
    place: &str,
    f: impl std::future::Future<Output = Result<T, tollgate_keys::KeysError>>,
) -> Result<T, String> {
    match tokio::time::timeout(STORE_TIMEOUT, f).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("{place}: no answer within {STORE_TIMEOUT:?}")),
    }
}

/// How far this gateway has read the key store. The keys themselves are held once, as the
/// compiler takes them, by the reloader (`Reloader::managed`): a record's other fields are
/// read from the store when the API shows it.
struct Held {
    generation: u64,
}

pub struct ManagedKeys {
    store: KeyStore,
    reloader: Arc<Reloader>,
    rules: Arc<ArcSwap<Snapshot>>,
    metrics: Arc<Metrics>,
    clock: Arc<dyn Clock>,
    /// Writes on this gateway one at a time, and the follower between them.
    held: Mutex<Held>,
}

impl ManagedKeys {
    /// Loads every key from `store` and puts them in place beside the rules file's. A key that
    /// no longer compiles against the rules (a limit it names was removed) is left out and
    /// named in the log; its callers get 401 until it is patched.
    pub async fn load(
        store: KeyStore,
        reloader: Arc<Reloader>,
        rules: Arc<ArcSwap<Snapshot>>,
        metrics: Arc<Metrics>,
        clock: Arc<dyn Clock>,
    ) -> Result<Arc<ManagedKeys>, String> {
        // A store that can't be reached at start must not keep the gateway from serving: the
        // follower asks for every change from generation 0 once it answers.
        let (generation, records) = match within(store.place(), store.load_all()).await {
            Ok(all) => all,
            Err(e) => {
                tracing::warn!(error = %e, "managed keys: cannot load them yet; they are served once the store answers");
                (0, Vec::new())
            }
        };
        let keys = Arc::new(ManagedKeys {
            store,
            reloader,
            rules,
            metrics,
            clock,
            held: Mutex::new(Held { generation }),
        });
        let n = records.len();
        keys.put_in_place(records.iter().map(managed_key).collect())
            .map_err(|e| e.to_string())?;
        tracing::info!(keys = n, place = keys.store.place(), "managed keys loaded");
        Ok(keys)
    }

    /// Follows the store's changes every [`FOLLOW_EVERY`] until `stop`. A store that can't be
    /// reached leaves the keys this gateway has in place.
    pub async fn follow(self: Arc<Self>, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        let mut tick = tokio::time::interval(FOLLOW_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = &mut stop => return,
            }
            match self.catch_up().await {
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!(
                        place = self.store.place(),
                        "managed keys: the store answers again"
                    );
                }
                Ok(()) => {}
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "managed keys: cannot read changes; keeping the keys this gateway has");
                }
                Err(_) => {}
            }
        }
    }

    async fn catch_up(&self) -> Result<(), String> {
        // Held across the read: a change this gateway writes meanwhile must not be replaced by
        // the record as it was before it.
        let mut held = self.held.lock().await;
        let since = held.generation;
        let place = self.store.place();
        let (generation, records) = within(place, self.store.changes_since(since)).await?;
        let (generation, records, whole) = if generation < since {
            // The store was emptied or replaced: what it holds now is all there is.
            let (g, all) = within(place, self.store.load_all()).await?;
            (g, all, true)
        } else {
            (generation, records, false)
        };
        if records.is_empty() && !whole {
            return Ok(());
        }
        let set = if whole {
            records.iter().map(managed_key).collect()
        } else {
            self.merged(&records)
        };
        held.generation = if whole {
            generation
        } else {
            held.generation.max(generation)
        };
        self.put_in_place(set).map_err(|e| e.to_string())
    }

    /// The keys in place with `records` put over them by id, or added.
    fn merged(&self, records: &[KeyRecord]) -> Vec<ManagedKey> {
        let mut set: Vec<ManagedKey> = self.reloader.managed();
        let at: std::collections::HashMap<String, usize> =
            set.iter().enumerate().map(|(i, k)| (k.id.clone(), i)).collect();
        for r in records {
            match at.get(&r.id) {
                Some(&i) => set[i] = managed_key(r),
                None => set.push(managed_key(r)),
            }
        }
        set
    }

    /// Compiles the held keys beside the file's and swaps the result in, leaving out each key
    /// that does not compile.
    fn put_in_place(&self, set: Vec<ManagedKey>) -> Result<(), KeysRefused> {
        // One compile when every key compiles, as nearly always: only a failure looks for
        // the keys to leave out.
        match self.reloader.set_managed(&set) {
            Err(KeysRefused::Key(_)) => {}
            done => return done,
        }
        let (set, left_out) = compilable(&self.reloader, set);
        for (id, why) in left_out {
            tracing::error!(key = %id, reason = %why, "managed key left out: it does not compile against the running rules");
        }
        self.reloader.set_managed(&set)
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_microsecond(self.clock.now_us() as i64).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    /// `/admin/keys…`, once the caller's token has been checked.
    pub async fn serve(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let path = req.uri().path().to_string();
        let query = req.uri().query().map(str::to_string);
        let method = req.method().clone();
        let rest = path.strip_prefix("/admin/keys").unwrap_or("");
        let parts = match segments(rest) {
            Ok(p) => p,
            Err(f) => return f.into_response(),
        };
        let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
        let body = match read_body(req).await {
            Ok(b) => b,
            Err(f) => return f.into_response(),
        };
        let answer = match (&method, parts.as_slice()) {
            (&Method::GET, []) => self.list(query.as_deref()).await,
            (&Method::POST, []) => self.create(&body, peer).await,
            (&Method::GET, [id]) => self.get(id).await,
            (&Method::PATCH, [id]) => self.patch(id, &body, peer).await,
            (&Method::POST, [id, "rotate"]) => self.rotate(id, &body, peer).await,
            (&Method::POST, [id, "revoke"]) => self.revoke(id, peer).await,
            (_, [] | [_] | [_, "rotate" | "revoke"]) => Err(ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
            )),
            _ => Err(not_found()),
        };
        answer.unwrap_or_else(ApiError::into_response)
    }

    async fn list(&self, query: Option<&str>) -> Result<Response<Body>, ApiError> {
        let tenant = query.and_then(|q| {
            q.split('&')
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| *k == "tenant")
                .map(|(_, v)| v.to_string())
        });
        let (_, all) = within(self.store.place(), self.store.load_all())
            .await
            .map_err(|e| unavailable(&e))?;
        let keys: Vec<Value> = all
            .iter()
            .filter(|r| tenant.as_deref().is_none_or(|t| r.tenant == t))
            .map(KeyRecord::public_view)
            .collect();
        Ok(json_response(StatusCode::OK, json!({ "keys": keys }).to_string()))
    }

    async fn get(&self, id: &str) -> Result<Response<Body>, ApiError> {
        let rec = self.fresh(id).await?;
        Ok(json_response(StatusCode::OK, rec.public_view().to_string()))
    }

    async fn create(&self, body: &[u8], peer: SocketAddr) -> Result<Response<Body>, ApiError> {
        let now = self.now();
        let c = Create::parse(body, now).map_err(bad)?;
        let _one_at_a_time = self.held.lock().await;
        if let Some(id) = &c.id {
            self.check_free(id)?;
        }
        let (rec, secret) = change::create(c, now);
        self.check_free(&rec.id)?;
        self.check_compiles(&rec)?;
        match within(self.store.place(), self.store.insert_new(&rec)).await {
            Ok(true) => {}
            Ok(false) => return Err(conflict(&format!("key {:?} exists", rec.id))),
            Err(e) => return Err(unavailable(&e)),
        }
        let id = rec.id.clone();
        self.settle(&rec, "create", peer, now);
        Ok(json_response(
            StatusCode::CREATED,
            json!({"id": id, "secret": secret}).to_string(),
        ))
    }

    async fn rotate(&self, id: &str, body: &[u8], peer: SocketAddr) -> Result<Response<Body>, ApiError> {
        let now = self.now();
        let r = Rotate::parse(body).map_err(bad)?;
        let _one_at_a_time = self.held.lock().await;
        let current = self.fresh(id).await?;
        let (rec, secret) = change::rotate(&current, r.grace_s, now).map_err(|e| conflict(&e.to_string()))?;
        self.write(&rec).await?;
        self.settle(&rec, "rotate", peer, now);
        Ok(json_response(
            StatusCode::OK,
            json!({"id": id, "secret": secret}).to_string(),
        ))
    }

    async fn revoke(&self, id: &str, peer: SocketAddr) -> Result<Response<Body>, ApiError> {
        let now = self.now();
        let _one_at_a_time = self.held.lock().await;
        let rec = change::revoke(&self.fresh(id).await?, now);
        self.write(&rec).await?;
        self.settle(&rec, "revoke", peer, now);
        Ok(json_response(StatusCode::OK, rec.public_view().to_string()))
    }

    async fn patch(&self, id: &str, body: &[u8], peer: SocketAddr) -> Result<Response<Body>, ApiError> {
        let now = self.now();
        let p = Patch::parse(body, now).map_err(bad)?;
        let _one_at_a_time = self.held.lock().await;
        let rec = change::patch(&self.fresh(id).await?, p, now).map_err(|e| conflict(&e.to_string()))?;
        self.check_compiles(&rec)?;
        self.write(&rec).await?;
        self.settle(&rec, "patch", peer, now);
        Ok(json_response(StatusCode::OK, rec.public_view().to_string()))
    }

    /// The key as the store has it now: another gateway may have changed it since this one
    /// last followed.
    async fn fresh(&self, id: &str) -> Result<KeyRecord, ApiError> {
        match within(self.store.place(), self.store.get(id)).await {
            Ok(Some(rec)) => Ok(rec),
            Ok(None) => Err(not_found()),
            Err(e) => Err(unavailable(&e)),
        }
    }

    async fn write(&self, rec: &KeyRecord) -> Result<(), ApiError> {
        within(self.store.place(), self.store.put(rec))
            .await
            .map_err(|e| unavailable(&e))
    }

    /// An id the rules file or the running keys already have is the caller's conflict (the
    /// store's own refusal catches one made elsewhere a moment ago).
    fn check_free(&self, id: &str) -> Result<(), ApiError> {
        let snap = self.rules.load();
        match snap.key_by_id(id) {
            Some(k) if snap.keys[k].managed => Err(conflict(&format!("key {id:?} exists"))),
            Some(_) => Err(conflict(&format!("key {id:?} is in the rules file"))),
            None => Ok(()),
        }
    }

    /// Whether `rec` compiles beside the file's keys and the other running keys: a limit it
    /// names must exist and take per-key numbers, a tenant's keys must share numbers.
    fn check_compiles(&self, rec: &KeyRecord) -> Result<(), ApiError> {
        let mut set: Vec<ManagedKey> = self
            .reloader
            .managed()
            .into_iter()
            .filter(|k| k.id != rec.id)
            .collect();
        set.push(managed_key(rec));
        match self.reloader.check_managed(&set) {
            Ok(()) => Ok(()),
            Err(KeysRefused::Key(e)) if managed_index(&e.field) == Some(set.len() - 1) => {
                Err(bad(FieldError {
                    field: e
                        .field
                        .split_once('.')
                        .map_or(String::new(), |(_, f)| f.to_string()),
                    reason: e.reason,
                }))
            }
            Err(e) => Err(unavailable(&e.to_string())),
        }
    }

    /// After a change is stored: this gateway serves it at once, and it is audited.
    fn settle(&self, rec: &KeyRecord, action: &'static str, peer: SocketAddr, now: Timestamp) {
        if let Err(e) = self.put_in_place(self.merged(std::slice::from_ref(rec))) {
            tracing::error!(error = %e, "managed keys: the change is stored but not in place here");
        }
        self.metrics.admin_change(action);
        tracing::info!(target: "tollgate::audit", action, key = %rec.id, at = %now, peer = %peer, "admin change");
    }
}

/// The keys of `set` that compile beside the file's, and each left out with why. One bad key must not take the others down with it.
fn compilable(reloader: &Reloader, mut set: Vec<ManagedKey>) -> (Vec<ManagedKey>, Vec<(String, String)>) {
    let mut left_out = Vec::new();
    // Each round removes the key the error names; a file error ends it (nothing to remove).
    while !set.is_empty() {
        match reloader.check_managed(&set) {
            Err(KeysRefused::Key(e)) => match managed_index(&e.field) {
                Some(i) if i < set.len() => {
                    let k = set.remove(i);
                    left_out.push((k.id, format!("{}: {}", e.field, e.reason)));
                }
                _ => break,
            },
            _ => break,
        }
    }
    (set, left_out)
}

/// The index `i` of a compile error's field `managed_keys[i]…`.
fn managed_index(field: &str) -> Option<usize> {
    field
        .strip_prefix("managed_keys[")
        .and_then(|r| r.split(']').next())
        .and_then(|i| i.parse().ok())
}

/// A record in the form the rules compiler takes: times as Unix seconds.
fn managed_key(r: &KeyRecord) -> ManagedKey {
    let secs = |t: Timestamp| t.as_second().max(0) as u64;
    ManagedKey {
        id: r.id.clone(),
        tenant: r.tenant.clone(),
        name: r.name.clone(),
        limits: r
            .limits
            .iter()
            .map(|(l, n)| (l.clone(), n.rate.clone(), n.burst))
            .collect(),
        secrets: r
            .secrets
            .iter()
            .map(|s| (s.hash, s.not_after.map(secs)))
            .collect(),
        expires_at: r.expires_at.map(secs),
        revoked: r.revoked,
    }
}

/// A body past [`MAX_BODY`] is refused, but read to its end first, up to this: a client
/// still sending when the answer comes and the connection closes gets a reset, not the answer.
const DRAIN_MAX: usize = 16 << 20;

async fn read_body(req: Request<Incoming>) -> Result<Vec<u8>, ApiError> {
    let mut body = req.into_body();
    let mut kept = Vec::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            bad(FieldError {
                field: String::new(),
                reason: format!("could not be read: {e}"),
            })
        })?;
        if let Ok(data) = frame.into_data() {
            seen += data.len();
            if seen <= MAX_BODY {
                kept.extend_from_slice(&data);
            } else if seen > DRAIN_MAX {
                break;
            }
        }
    }
    if seen > MAX_BODY {
        return Err(bad(FieldError {
            field: String::new(),
            reason: format!("larger than {MAX_BODY} bytes"),
        }));
    }
    Ok(kept)
}

/// The segments of a path under `/admin/keys`, each percent-decoded: ids keep to letters,
/// digits, `-`, `_` and `.`, but a key stored before they did may hold `/`, `?` or `%`, and is
/// reached as `/admin/keys/a%2Fb/revoke`.
fn segments(rest: &str) -> Result<Vec<String>, ApiError> {
    rest.split('/')
        .filter(|s| !s.is_empty())
        .map(|s| {
            percent_decode(s).ok_or_else(|| {
                ApiError::new(StatusCode::BAD_REQUEST, "bad_request")
                    .with("field", "path")
                    .with(
                        "reason",
                        format!("{s:?} is not a percent-encoded UTF-8 path segment"),
                    )
            })
        })
        .collect()
}

/// `%XX` escapes decoded; `None` for a broken escape or bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        if b != b'%' {
            out.push(b);
            continue;
        }
        let digit = |d: u8| (d as char).to_digit(16);
        let (hi, lo) = (digit(bytes.next()?)?, digit(bytes.next()?)?);
        out.push((hi * 16 + lo) as u8);
    }
    String::from_utf8(out).ok()
}

/// An answer other than success: its status and JSON body, made into a response at the end.
fn bad(e: FieldError) -> ApiError {
    let field = if e.field.is_empty() {
        "(body)".to_string()
    } else {
        e.field
    };
    ApiError::new(StatusCode::BAD_REQUEST, "bad_request")
        .with("field", field)
        .with("reason", e.reason)
}

fn conflict(reason: &str) -> ApiError {
    ApiError::new(StatusCode::CONFLICT, "conflict").with("reason", reason)
}

fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found")
}

fn unavailable(reason: &str) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "keys_unavailable").with("reason", reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_percent_decoded() {
        let parts = segments("/a%2Fb/revoke").ok().unwrap();
        assert_eq!(parts, ["a/b", "revoke"]);
        assert_eq!(segments("/q%3Fx").ok().unwrap(), ["q?x"]);
        assert_eq!(segments("/%2E%2E%2Fx").ok().unwrap(), ["../x"]);
        assert_eq!(segments("/k-7").ok().unwrap(), ["k-7"]);
        for broken in ["/a%2", "/a%zz", "/a%+1", "/%FF"] {
            assert!(segments(broken).is_err(), "{broken}");
        }
    }
}
