//! The ledger in Redis, beside the stream it adds up: the consumer group on `tollgate:usage`,
//! the keys the Lua scripts under `lua/meter_*.lua` keep, and the questions `usage` and
//! `export` ask of them. Every change to the ledger is one script call, so consumers can run
//! side by side. On a Redis Cluster every ledger key carries the hash tag `{meter}`, so a
//! record's keys share one slot and its script one primary.

use std::collections::HashSet;
use std::time::Duration;

use fred::interfaces::LuaInterface;
use fred::prelude::{
    Builder, Client, ClientLike, Config, ConnectionConfig, Error as FredError, PerformanceConfig,
    ReconnectPolicy, Value,
};
use fred::types::{ClusterHash, CustomCommand};

use crate::flags::{FLAGS, Flag};
use crate::ledger_types::{
    Calendar, Liveness, PassReport, PeriodLabel, Placed, RawEntry, Role, Usage, identity_code,
    identity_from_code,
};
use crate::record::{Identity, Kind, Record, RecordError, STREAM};
use tollgate_access::Access;
use tollgate_rules::quota::Per;

/// The consumer group every `tollgate meter` joins.
pub const GROUP: &str = "tollgate:meter";

/// The ledger's key names: `tollgate:meter:…` on one node, as earlier releases kept them, and
/// `tollgate:{meter}:…` on a cluster, one hash tag for every key a script touches.
#[derive(Debug, Clone, Copy)]
struct Names {
    prefix: &'static str,
}

const ON_A_NODE: Names = Names {
    prefix: "tollgate:meter:",
};
const ON_A_CLUSTER: Names = Names {
    prefix: "tollgate:{meter}:",
};

impl Names {
    fn live(&self) -> String {
        format!("{}live", self.prefix)
    }

    fn seq(&self) -> String {
        format!("{}seq", self.prefix)
    }

    fn ended(&self) -> String {
        format!("{}ended", self.prefix)
    }

    fn unclean(&self) -> String {
        format!("{}unclean", self.prefix)
    }

    fn key_last(&self) -> String {
        format!("{}key-last", self.prefix)
    }

    /// `hash key -> largest total` of one identity.
    fn max(&self, identity: &Identity) -> String {
        format!("{}max:{}", self.prefix, identity_code(identity))
    }

    /// `hash key -> admitted` of one period.
    fn usage(&self, per: Per, label: &str) -> String {
        format!("{}usage:{}:{label}", self.prefix, per.as_str())
    }

    /// The identities that added to one key in one period.
    fn ids(&self, per: Per, label: &str, key: &str) -> String {
        format!("{}ids:{}:{label}:{key}", self.prefix, per.as_str())
    }
}

const APPLY_SCRIPT: &str = include_str!("../../lua/meter_apply.lua");
const SILENCE_SCRIPT: &str = include_str!("../../lua/meter_silence.lua");
const FLAG_SCRIPT: &str = include_str!("../../lua/meter_flag.lua");

/// Identities taken per silence call: a script blocks the node while it runs.
const SILENT_PER_CALL: usize = 100;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

pub struct RedisLedger {
    client: Client,
    url: String,
    names: Names,
    /// This process's name in the group, when it reads records.
    consumer: Option<String>,
    claim_idle_ms: u64,
    apply_sha: String,
    silence_sha: String,
    flag_sha: String,
}

fn command(name: &'static str) -> CustomCommand {
    CustomCommand::new_static(name, ClusterHash::FirstKey, false)
}

/// A command whose key is its `at`th argument (`EVALSHA sha n KEY`, `XINFO GROUPS KEY`), so a
/// cluster sends it to the key's primary.
fn command_at(name: &'static str, at: usize) -> CustomCommand {
    CustomCommand::new_static(name, ClusterHash::Offset(at), false)
}

/// A cluster reached through `nodes` (`H1:P1,H2:P2`), the rest found from its slot map.
fn cluster_config(url: &str, nodes: &str) -> Result<Config, String> {
    let mut hosts = Vec::new();
    for n in nodes.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let (host, port) = n
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .ok_or_else(|| format!("--store {url}: {n:?} must be HOST:PORT"))?;
        hosts.push(fred::types::config::Server::new(host, port));
    }
    if hosts.is_empty() {
        return Err(format!(
            "--store {url}: a cluster URL needs at least one HOST:PORT"
        ));
    }
    Ok(Config {
        server: fred::types::config::ServerConfig::Clustered {
            hosts,
            policy: Default::default(),
        },
        ..Config::default()
    })
}

fn text(v: &Value) -> Option<String> {
    v.as_str().map(|s| s.into_owned())
}

fn int(v: &Value) -> Option<i64> {
    v.as_i64()
}

/// The milliseconds of a stream entry id (`1764547200000-0`).
fn id_ms(id: &str) -> Option<i64> {
    id.split_once('-').and_then(|(ms, _)| ms.parse().ok())
}

fn is_noscript(e: &FredError) -> bool {
    e.details().starts_with("NOSCRIPT")
}

/// One entry of an XREADGROUP or XAUTOCLAIM reply: `[id, [field, value, ...]]`. `None` for an
/// entry deleted from the stream while it was pending.
fn entry(v: Value) -> Option<RawEntry> {
    let mut parts = v.into_array().into_iter();
    let id = text(&parts.next()?)?;
    let fields = parts.next()?;
    if fields.is_null() {
        return None;
    }
    let at_ms = id_ms(&id).unwrap_or(0);
    let values = fields.into_array();
    let mut pairs = Vec::with_capacity(values.len() / 2);
    let mut unreadable = None;
    for pair in values.chunks(2) {
        match (pair.first().and_then(text), pair.get(1).and_then(text)) {
            (Some(n), Some(v)) => pairs.push((n, v)),
            (name, _) => unreadable = Some(name.unwrap_or_else(|| "(a field name)".into())),
        }
    }
    let record = match unreadable {
        Some(name) => Err(RecordError {
            field: "(fields)",
            reason: format!("field {name:?} is not UTF-8 text"),
        }),
        None => Record::from_fields(pairs.iter().map(|(n, v)| (n.as_str(), v.as_str()))),
    };
    Some(RawEntry { id, at_ms, record })
}

impl RedisLedger {
    pub async fn connect(url: &str, access: &Access, role: Role) -> Result<RedisLedger, String> {
        let shown = tollgate_access::redact(url);
        let cluster = url
            .strip_prefix("redis-cluster://")
            .map(|n| (n, false))
            .or_else(|| url.strip_prefix("rediss-cluster://").map(|n| (n, true)));
        // TLS comes from `access`, never from fred's reading of the scheme.
        let node = url
            .strip_prefix("redis://")
            .map(|r| (r, false))
            .or_else(|| url.strip_prefix("rediss://").map(|r| (r, true)));
        let (mut config, names, tls) = match (cluster, node) {
            (Some((nodes, tls)), _) => (cluster_config(&shown, nodes)?, ON_A_CLUSTER, tls),
            (None, Some((rest, tls))) => (
                Config::from_url_centralized(&format!("redis://{rest}"))
                    .map_err(|e| format!("--store {shown}: not a usable redis:// URL: {}", e.details()))?,
                ON_A_NODE,
                tls,
            ),
            (None, None) => {
                return Err(format!(
                    "--store {shown}: not a redis://HOST:PORT or redis-cluster://H1:P1,H2:P2 URL (rediss… over TLS; use --meter-file PATH for the embedded store)"
                ));
            }
        };
        access
            .apply(&mut config, tls)
            .map_err(|e| format!("--store {shown}: {e}"))?;
        let url = shown.as_str();
        let client = Builder::from_config(Config {
            fail_fast: true,
            ..config
        })
        .with_connection_config(|c: &mut ConnectionConfig| {
            c.connection_timeout = CONNECT_TIMEOUT;
            c.internal_command_timeout = CONNECT_TIMEOUT;
        })
        .with_performance_config(|p: &mut PerformanceConfig| {
            p.default_command_timeout = COMMAND_TIMEOUT;
        })
        // Unlimited attempts, 500 ms apart: a long-running consumer outlives a store restart.
        .set_policy(ReconnectPolicy::new_constant(0, 500))
        .build()
        .map_err(|e| format!("--store {url}: {}", e.details()))?;
        client
            .init()
            .await
            .map_err(|e| format!("cannot connect to the Redis store at {url}: {}", e.details()))?;
        let mut ledger = RedisLedger {
            client,
            url: url.to_string(),
            names,
            consumer: None,
            claim_idle_ms: 0,
            apply_sha: fred::util::sha1_hash(APPLY_SCRIPT),
            silence_sha: fred::util::sha1_hash(SILENCE_SCRIPT),
            flag_sha: fred::util::sha1_hash(FLAG_SCRIPT),
        };
        ledger.load_scripts().await?;
        if let Role::Consumer { claim_idle_ms } = role {
            // From 0: a group made after records were written still adds up all of them.
            let made = ledger
                .call_at(
                    "XGROUP",
                    1,
                    vec![
                        "CREATE".into(),
                        STREAM.into(),
                        GROUP.into(),
                        "0".into(),
                        "MKSTREAM".into(),
                    ],
                )
                .await;
            if let Err(e) = made
                && !e.contains("BUSYGROUP")
            {
                return Err(e);
            }
            ledger.consumer = Some(format!(
                "meter-{}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ));
            ledger.claim_idle_ms = claim_idle_ms;
        }
        Ok(ledger)
    }

    fn fail(&self, what: &str, e: FredError) -> String {
        format!("Redis store {}: {what}: {}", self.url, e.details())
    }

    async fn call(&self, name: &'static str, args: Vec<Value>) -> Result<Value, String> {
        self.client
            .custom::<Value, Value>(command(name), args)
            .await
            .map_err(|e| self.fail(name, e))
    }

    async fn call_at(&self, name: &'static str, at: usize, args: Vec<Value>) -> Result<Value, String> {
        self.client
            .custom::<Value, Value>(command_at(name, at), args)
            .await
            .map_err(|e| self.fail(name, e))
    }

    async fn load_scripts(&self) -> Result<(), String> {
        for (file, script) in [
            ("lua/meter_apply.lua", APPLY_SCRIPT),
            ("lua/meter_silence.lua", SILENCE_SCRIPT),
            ("lua/meter_flag.lua", FLAG_SCRIPT),
        ] {
            // On every primary of a cluster.
            self.client
                .script_load_cluster::<(), _>(script)
                .await
                .map_err(|e| format!("the Redis store at {} refused {file}: {}", self.url, e.details()))?;
        }
        Ok(())
    }

    /// EVALSHA, loading the scripts again if the store lost them (a restart, SCRIPT FLUSH).
    async fn eval(&self, sha: &str, keys: Vec<String>, args: Vec<Value>) -> Result<Value, String> {
        let mut all: Vec<Value> = vec![sha.into(), (keys.len() as i64).into()];
        all.extend(keys.into_iter().map(Value::from));
        all.extend(args);
        match self
            .client
            .custom::<Value, Value>(command_at("EVALSHA", 2), all.clone())
            .await
        {
            Err(e) if is_noscript(&e) => {
                self.load_scripts().await?;
                self.call_at("EVALSHA", 2, all).await
            }
            other => other.map_err(|e| self.fail("EVALSHA", e)),
        }
    }

    pub async fn now_ms(&self) -> Result<i64, String> {
        let t = self.call("TIME", vec![]).await?.into_array();
        match (t.first().and_then(int), t.get(1).and_then(int)) {
            (Some(s), Some(us)) => Ok(s * 1000 + us / 1000),
            _ => Err(format!("Redis store {}: TIME answered {t:?}", self.url)),
        }
    }

    fn consumer(&self) -> &str {
        self.consumer
            .as_deref()
            .expect("only a consumer reads the stream")
    }

    /// Entries another consumer took and left unacknowledged for `claim_idle_ms`: it stopped or
    /// failed, and its records must still be added up.
    async fn claim(&self, max: usize) -> Result<Vec<RawEntry>, String> {
        let reply = self
            .call(
                "XAUTOCLAIM",
                vec![
                    STREAM.into(),
                    GROUP.into(),
                    self.consumer().into(),
                    (self.claim_idle_ms as i64).into(),
                    "0-0".into(),
                    "COUNT".into(),
                    (max as i64).into(),
                ],
            )
            .await?;
        let mut parts = reply.into_array().into_iter();
        let entries = parts.nth(1).map(Value::into_array).unwrap_or_default();
        Ok(entries.into_iter().filter_map(entry).collect())
    }

    async fn read_new(&self, max: usize) -> Result<Vec<RawEntry>, String> {
        let reply = self
            .call_at(
                "XREADGROUP",
                6,
                vec![
                    "GROUP".into(),
                    GROUP.into(),
                    self.consumer().into(),
                    "COUNT".into(),
                    (max as i64).into(),
                    "STREAMS".into(),
                    STREAM.into(),
                    ">".into(),
                ],
            )
            .await?;
        if reply.is_null() {
            return Ok(Vec::new());
        }
        // [[stream, [entry, ...]]]
        let mut out = Vec::new();
        for stream in reply.into_array() {
            let mut parts = stream.into_array().into_iter();
            if let Some(entries) = parts.nth(1) {
                out.extend(entries.into_array().into_iter().filter_map(entry));
            }
        }
        Ok(out)
    }

    fn apply_call(&self, p: &Placed) -> (Vec<String>, Vec<Value>) {
        let r = &p.record;
        let code = identity_code(&r.identity);
        let n = &self.names;
        let mut keys = vec![n.live(), n.seq(), n.ended(), n.unclean()];
        let mut args: Vec<Value> = vec![
            Value::from(""),
            code.into(),
            (r.seq as i64).into(),
            p.at_ms.into(),
        ];
        match &r.kind {
            Kind::Usage { key, total } => {
                args[0] = "usage".into();
                keys.extend([
                    n.max(&r.identity),
                    n.usage(Per::Day, &p.day),
                    n.usage(Per::Month, &p.month),
                    n.ids(Per::Day, &p.day, key),
                    n.ids(Per::Month, &p.month, key),
                    n.key_last(),
                ]);
                args.push(key.as_str().into());
                args.push(total.to_string().into());
            }
            Kind::End => args[0] = "end".into(),
        }
        (keys, args)
    }

    /// One script call per record, sent in one pipeline.
    async fn apply(&self, placed: &[Placed]) -> Result<Vec<(u64, Liveness)>, String> {
        let mut reloaded = false;
        loop {
            let pipe = self.client.pipeline();
            for p in placed {
                let (keys, args) = self.apply_call(p);
                let mut all: Vec<Value> = vec![self.apply_sha.as_str().into(), (keys.len() as i64).into()];
                all.extend(keys.into_iter().map(Value::from));
                all.extend(args);
                pipe.custom::<(), Value>(command_at("EVALSHA", 2), all)
                    .await
                    .map_err(|e| self.fail("EVALSHA", e))?;
            }
            let replies = pipe.try_all::<Value>().await;
            if !reloaded && replies.iter().any(|r| r.as_ref().is_err_and(is_noscript)) {
                // Applying twice changes nothing, so the whole batch goes again.
                self.load_scripts().await?;
                reloaded = true;
                continue;
            }
            let mut out = Vec::with_capacity(placed.len());
            for (p, reply) in placed.iter().zip(replies) {
                let reply = reply.map_err(|e| self.fail(&format!("applying entry {}", p.id), e))?;
                let v = reply.into_array();
                let (added, liveness) = match (v.first().and_then(int), v.get(1).and_then(int)) {
                    (Some(a), Some(l)) => (a.max(0) as u64, l),
                    _ => {
                        return Err(format!(
                            "Redis store {}: lua/meter_apply.lua answered {v:?} for entry {}",
                            self.url, p.id
                        ));
                    }
                };
                let liveness = match liveness {
                    1 => Liveness::Resumed,
                    2 => Liveness::EndedAfterReport,
                    _ => Liveness::Unchanged,
                };
                out.push((added, liveness));
            }
            return Ok(out);
        }
    }

    pub async fn pass(&mut self, max: usize, cal: &mut Calendar) -> Result<PassReport, String> {
        let mut raw = self.claim(max).await?;
        if raw.is_empty() {
            raw = self.read_new(max).await?;
        }
        let mut report = PassReport::of(&raw);
        if raw.is_empty() {
            return Ok(report);
        }
        let ids: Vec<Value> = raw.iter().map(|e| Value::from(e.id.as_str())).collect();
        let (placed, malformed) = cal.place(raw);
        let results = self.apply(&placed).await?;
        for (p, (added, liveness)) in placed.iter().zip(results) {
            report.count(p, added, liveness);
        }
        report.malformed = malformed;
        // Only now: a consumer that dies before this leaves them pending, to be claimed and
        // applied again, which changes nothing that was already applied.
        let mut ack: Vec<Value> = vec![STREAM.into(), GROUP.into()];
        ack.extend(ids);
        self.call("XACK", ack).await?;
        Ok(report)
    }

    pub(crate) async fn oldest_pending_ms(&self) -> Result<Option<i64>, String> {
        let mut oldest: Option<i64> = None;
        // Delivered to some consumer, not yet acknowledged.
        let pending = self
            .call("XPENDING", vec![STREAM.into(), GROUP.into()])
            .await?
            .into_array();
        if pending.first().and_then(int).unwrap_or(0) > 0 {
            oldest = pending.get(1).and_then(text).as_deref().and_then(id_ms);
        }
        // Not yet delivered to any: the first entry after the group's last delivered id.
        let groups = self
            .call_at("XINFO", 1, vec!["GROUPS".into(), STREAM.into()])
            .await?;
        let mut last_delivered = None;
        for g in groups.into_array() {
            let fields = g.into_array();
            let get = |name: &str| {
                fields
                    .chunks(2)
                    .find(|kv| kv.first().and_then(text).as_deref() == Some(name))
                    .and_then(|kv| kv.get(1).and_then(text))
            };
            if get("name").as_deref() == Some(GROUP) {
                last_delivered = get("last-delivered-id");
            }
        }
        let last_delivered = last_delivered.ok_or_else(|| {
            format!(
                "Redis store {}: the consumer group {GROUP} on {STREAM} is gone",
                self.url
            )
        })?;
        let next = self
            .call(
                "XRANGE",
                vec![
                    STREAM.into(),
                    format!("({last_delivered}").into(),
                    "+".into(),
                    "COUNT".into(),
                    1.into(),
                ],
            )
            .await?;
        if let Some(first) = next.into_array().into_iter().next().and_then(entry) {
            oldest = Some(oldest.map_or(first.at_ms, |o| o.min(first.at_ms)));
        }
        Ok(oldest)
    }

    pub(crate) async fn take_silent(&self, before_ms: i64) -> Result<Vec<(Identity, i64)>, String> {
        let mut out = Vec::new();
        loop {
            let found = self
                .eval(
                    &self.silence_sha,
                    vec![self.names.live(), self.names.unclean()],
                    vec![before_ms.into(), (SILENT_PER_CALL as i64).into()],
                )
                .await?
                .into_array();
            let n = found.len() / 2;
            for pair in found.chunks(2) {
                let code = pair.first().and_then(text).unwrap_or_default();
                let ms = pair.get(1).and_then(text).and_then(|s| s.parse::<f64>().ok());
                match identity_from_code(&code) {
                    Ok(id) => out.push((id, ms.unwrap_or(0.0) as i64)),
                    Err(e) => tracing::error!(error = %e, "Redis store {}: unreadable identity", self.url),
                }
            }
            if n < SILENT_PER_CALL {
                return Ok(out);
            }
        }
    }

    pub(crate) async fn key_last_ms(&self, keys: &[&str]) -> Result<Vec<Option<i64>>, String> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut args: Vec<Value> = vec![self.names.key_last().into()];
        args.extend(keys.iter().map(|k| Value::from(*k)));
        let v = self.call("HMGET", args).await?.into_array();
        Ok(v.iter().map(int).collect())
    }

    pub async fn set_flag(&self, key: &str, flag: &Flag) -> Result<bool, String> {
        let json = serde_json::to_string(flag).expect("a flag serializes");
        let written = self
            .eval(
                &self.flag_sha,
                vec![FLAGS.into()],
                vec![
                    key.into(),
                    json.into(),
                    flag.quota.as_str().into(),
                    flag.resets_at_ms.into(),
                    (flag.used as i64).into(),
                ],
            )
            .await?;
        Ok(int(&written) == Some(1))
    }

    pub(crate) async fn drop_flags_except(&self, keep: &HashSet<&str>) -> Result<Vec<String>, String> {
        let all = self.call("HKEYS", vec![FLAGS.into()]).await?.into_array();
        let stale: Vec<String> = all
            .iter()
            .filter_map(text)
            .filter(|k| !keep.contains(k.as_str()))
            .collect();
        if !stale.is_empty() {
            let mut args: Vec<Value> = vec![FLAGS.into()];
            args.extend(stale.iter().map(|k| Value::from(k.as_str())));
            self.call("HDEL", args).await?;
        }
        Ok(stale)
    }

    async fn contributors(&self, period: &PeriodLabel, key: &str) -> Result<(u64, u64), String> {
        let ids = self.names.ids(period.per, &period.label, key);
        let all = self.call("SCARD", vec![ids.as_str().into()]).await?;
        let unclean = self
            .call("SINTER", vec![ids.as_str().into(), self.names.unclean().into()])
            .await?
            .into_array();
        Ok((int(&all).unwrap_or(0) as u64, unclean.len() as u64))
    }

    pub async fn usage(&self, period: &PeriodLabel, key: &str) -> Result<Usage, String> {
        let admitted = self
            .call(
                "HGET",
                vec![self.names.usage(period.per, &period.label).into(), key.into()],
            )
            .await?;
        let admitted = int(&admitted).unwrap_or(0).max(0) as u64;
        let (identities, unclean_ends) = self.contributors(period, key).await?;
        Ok(Usage {
            admitted,
            identities,
            unclean_ends,
        })
    }

    pub(crate) async fn period_rows(&self, period: &PeriodLabel) -> Result<Vec<(String, Usage)>, String> {
        let all = self
            .call(
                "HGETALL",
                vec![self.names.usage(period.per, &period.label).into()],
            )
            .await?
            .into_array();
        let mut rows = Vec::new();
        for kv in all.chunks(2) {
            let (Some(key), Some(admitted)) = (kv.first().and_then(text), kv.get(1).and_then(int)) else {
                continue;
            };
            let (identities, unclean_ends) = self.contributors(period, &key).await?;
            rows.push((
                key,
                Usage {
                    admitted: admitted.max(0) as u64,
                    identities,
                    unclean_ends,
                },
            ));
        }
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(rows)
    }

    /// Leaves the group when nothing is pending for this consumer, so short runs (`--once`
    /// from cron) don't pile up names in it.
    pub async fn close(self) {
        if let Some(name) = &self.consumer {
            let mine = self
                .call(
                    "XPENDING",
                    vec![
                        STREAM.into(),
                        GROUP.into(),
                        "-".into(),
                        "+".into(),
                        1.into(),
                        name.as_str().into(),
                    ],
                )
                .await;
            if matches!(&mine, Ok(v) if v.clone().into_array().is_empty() || v.is_null()) {
                let _ = self
                    .call_at(
                        "XGROUP",
                        1,
                        vec![
                            "DELCONSUMER".into(),
                            STREAM.into(),
                            GROUP.into(),
                            name.as_str().into(),
                        ],
                    )
                    .await;
            }
        }
        let _ = self.client.quit().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reads_into_a_record_or_an_error_naming_its_field() {
        let e = entry(Value::Array(vec![
            "1764547200000-3".into(),
            Value::Array(
                [
                    "gateway", "gw", "boot", "b", "seq", "2", "kind", "usage", "key", "k-7", "total", "9",
                ]
                .map(Value::from)
                .to_vec(),
            ),
        ]))
        .unwrap();
        assert_eq!(e.at_ms, 1_764_547_200_000);
        assert_eq!(
            e.record.unwrap().kind,
            Kind::Usage {
                key: "k-7".into(),
                total: 9
            }
        );
        let e = entry(Value::Array(vec![
            "5-0".into(),
            Value::Array(["gateway", "gw", "kind", "end"].map(Value::from).to_vec()),
        ]))
        .unwrap();
        assert_eq!(e.record.unwrap_err().field, "boot");
        // Deleted while pending.
        assert!(entry(Value::Array(vec!["6-0".into(), Value::Null])).is_none());
    }
}
