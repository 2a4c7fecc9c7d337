//! The admin API's bodies, read and checked field by field, and the changes they make to a
//! key's record: pure functions of the record and of the time handed in, so the gateway's
//! admin handlers only read a body, call one of these and store the result.
//!
//! Limit names in `limits` are not checked here: which limits exist is the rules' business,
//! so the gateway checks each name against the rules it runs (and a key that names a limit
//! the rules no longer have is the gateway's to report, not this crate's to refuse).

use std::collections::BTreeMap;
use std::fmt;

use jiff::{SignedDuration, Timestamp};
use serde_json::{Map, Value};
use tollgate_limit::bucket::{BucketParams, Rate};

use crate::record::{KeyRecord, Numbers, Secret};
use crate::secret;

/// A body the admin API refuses, naming the field at fault (`limits.plan.rate`, `tenant`) or
/// `""` for the body as a whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub reason: String,
}

impl FieldError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> FieldError {
        FieldError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "the body: {}", self.reason)
        } else {
            write!(f, "{}: {}", self.field, self.reason)
        }
    }
}

impl std::error::Error for FieldError {}

/// A change the record's state forbids; the gateway answers 409.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("key {id:?} is revoked; revocation is final, create a new key")]
    Revoked { id: String },
    #[error(
        "key {id:?} already has {live} working secrets (at most {MAX_SECRETS}); rotate with a shorter grace_s or wait for one to lapse"
    )]
    TooManySecrets { id: String, live: usize },
}

/// The longest a rotated-out secret may keep working.
pub const MAX_GRACE_S: u64 = 30 * 24 * 3_600;

/// The most secrets of one key that may work at once, so rotating in a loop can't grow a
/// record without end.
pub const MAX_SECRETS: usize = 10;

/// The longest tenant, in characters. Ids keep to the rules file's own bound,
/// [`tollgate_rules::keys::MAX_ID_LEN`].
pub const MAX_TENANT_LEN: usize = 64;

/// The longest name, in characters.
pub const MAX_NAME_LEN: usize = 200;

/// `POST` body of a new key: `{"id"?, "tenant", "name"?, "limits"?, "expires_at"?}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Create {
    /// `None`: one is made (`k_` and 12 base62 characters).
    pub id: Option<String>,
    pub tenant: String,
    pub name: Option<String>,
    pub limits: BTreeMap<String, Numbers>,
    pub expires_at: Option<Timestamp>,
}

impl Create {
    /// `now` is needed to refuse an `expires_at` that is already past.
    pub fn parse(body: &[u8], now: Timestamp) -> Result<Create, FieldError> {
        let obj = object(body)?;
        only(&obj, "", &["id", "tenant", "name", "limits", "expires_at"])?;
        let id = match obj.get("id") {
            None | Some(Value::Null) => None,
            Some(v) => Some(key_id(v)?),
        };
        let tenant = match obj.get("tenant") {
            None => {
                return Err(FieldError::new(
                    "tenant",
                    "missing: every key belongs to a tenant",
                ));
            }
            Some(v) => tenant(v)?,
        };
        let name = match obj.get("name") {
            None | Some(Value::Null) => None,
            Some(v) => Some(name(v)?),
        };
        let limits = match obj.get("limits") {
            None | Some(Value::Null) => BTreeMap::new(),
            Some(v) => limits(v)?,
        };
        let expires_at = match obj.get("expires_at") {
            None | Some(Value::Null) => None,
            Some(v) => Some(expiry(v, now)?),
        };
        Ok(Create {
            id,
            tenant,
            name,
            limits,
            expires_at,
        })
    }
}

/// The new key and its one secret, to be shown once. A made id that
/// [`KeyStore::insert_new`](crate::store::KeyStore::insert_new) finds taken (one in 62^12)
/// calls for another `create`; a given one taken is the caller's conflict (409).
pub fn create(c: Create, now: Timestamp) -> (KeyRecord, String) {
    let (secret, hash) = secret::generate();
    let record = KeyRecord {
        id: c.id.unwrap_or_else(|| format!("k_{}", secret::base62(12))),
        tenant: c.tenant,
        name: c.name,
        limits: c.limits,
        expires_at: c.expires_at,
        revoked: false,
        secrets: vec![Secret {
            hash,
            created_at: now,
            not_after: None,
        }],
        created_at: now,
        updated_at: now,
    };
    (record, secret)
}

/// Body of a rotation: `{"grace_s": N}`, how long the secrets it replaces keep working.
/// Required, since whether old secrets stop at once (a leak) or later (a routine change) is
/// the one decision a rotation makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotate {
    pub grace_s: u64,
}

impl Rotate {
    pub fn parse(body: &[u8]) -> Result<Rotate, FieldError> {
        let obj = object(body)?;
        only(&obj, "", &["grace_s"])?;
        let Some(v) = obj.get("grace_s") else {
            return Err(FieldError::new(
                "grace_s",
                "missing: seconds the old secrets keep working (0: they stop at once)",
            ));
        };
        match v.as_u64() {
            Some(n) if n <= MAX_GRACE_S => Ok(Rotate { grace_s: n }),
            _ => Err(FieldError::new(
                "grace_s",
                format!("must be a whole number of seconds from 0 to {MAX_GRACE_S} (30 days)"),
            )),
        }
    }
}

/// Adds a new secret; every older one stops at `now + grace_s` at the latest (a grace above
/// [`MAX_GRACE_S`] counts as that). Secrets already lapsed are dropped: they can never work
/// again.
pub fn rotate(rec: &KeyRecord, grace_s: u64, now: Timestamp) -> Result<(KeyRecord, String), Refusal> {
    if rec.revoked {
        return Err(Refusal::Revoked { id: rec.id.clone() });
    }
    let lapsed = |s: &Secret| s.not_after.is_some_and(|t| t <= now);
    let mut secrets: Vec<Secret> = rec.secrets.iter().filter(|s| !lapsed(s)).cloned().collect();
    if grace_s > 0 && secrets.len() >= MAX_SECRETS {
        return Err(Refusal::TooManySecrets {
            id: rec.id.clone(),
            live: secrets.len(),
        });
    }
    let grace = SignedDuration::from_secs(grace_s.min(MAX_GRACE_S) as i64);
    let until = now.checked_add(grace).unwrap_or(Timestamp::MAX);
    for s in &mut secrets {
        s.not_after = Some(s.not_after.map_or(until, |t| t.min(until)));
    }
    let (secret, hash) = secret::generate();
    secrets.push(Secret {
        hash,
        created_at: now,
        not_after: None,
    });
    let record = KeyRecord {
        secrets,
        updated_at: now,
        ..rec.clone()
    };
    Ok((record, secret))
}

/// Revokes the key; revoking a revoked key changes nothing.
pub fn revoke(rec: &KeyRecord, now: Timestamp) -> KeyRecord {
    if rec.revoked {
        return rec.clone();
    }
    KeyRecord {
        revoked: true,
        updated_at: now,
        ..rec.clone()
    }
}

/// `PATCH` body: `{"limits"?, "name"?, "expires_at"?}`. `limits` replaces the key's whole map
/// (`{}` leaves the key on the rules' numbers); `null` clears `name` or `expires_at`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Patch {
    pub limits: Option<BTreeMap<String, Numbers>>,
    /// `Some(None)`: clear the name.
    pub name: Option<Option<String>>,
    /// `Some(None)`: the key no longer expires.
    pub expires_at: Option<Option<Timestamp>>,
}

impl Patch {
    /// `now` is needed to refuse an `expires_at` that is already past.
    pub fn parse(body: &[u8], now: Timestamp) -> Result<Patch, FieldError> {
        let obj = object(body)?;
        only(&obj, "", &["limits", "name", "expires_at"])?;
        if obj.is_empty() {
            return Err(FieldError::new(
                "",
                "changes nothing: give limits, name or expires_at",
            ));
        }
        let limits = match obj.get("limits") {
            None => None,
            Some(Value::Null) => Some(BTreeMap::new()),
            Some(v) => Some(limits(v)?),
        };
        let name = match obj.get("name") {
            None => None,
            Some(Value::Null) => Some(None),
            Some(v) => Some(Some(name(v)?)),
        };
        let expires_at = match obj.get("expires_at") {
            None => None,
            Some(Value::Null) => Some(None),
            Some(v) => Some(Some(expiry(v, now)?)),
        };
        Ok(Patch {
            limits,
            name,
            expires_at,
        })
    }
}

/// Applies a patch. A revoked key can't be changed: nothing about it matters any more, and
/// a change would read as if it did.
pub fn patch(rec: &KeyRecord, p: Patch, now: Timestamp) -> Result<KeyRecord, Refusal> {
    if rec.revoked {
        return Err(Refusal::Revoked { id: rec.id.clone() });
    }
    let mut out = rec.clone();
    if let Some(limits) = p.limits {
        out.limits = limits;
    }
    if let Some(name) = p.name {
        out.name = name;
    }
    if let Some(expires_at) = p.expires_at {
        out.expires_at = expires_at;
    }
    out.updated_at = now;
    Ok(out)
}

fn object(body: &[u8]) -> Result<Map<String, Value>, FieldError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(FieldError::new("", "must be a JSON object")),
        Err(e) => Err(FieldError::new("", format!("not JSON: {e}"))),
    }
}

/// Refuses a field outside `allowed`: a misspelt `expire_at` silently ignored would leave a
/// key that never expires.
fn only(obj: &Map<String, Value>, at: &str, allowed: &[&str]) -> Result<(), FieldError> {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(FieldError::new(
            format!("{at}{k}"),
            format!("unknown field; expected one of {}", allowed.join(", ")),
        )),
        None => Ok(()),
    }
}

/// A key id: what the rules file accepts for its keys' ids (`tollgate_rules::keys::id_problem`),
/// so every id the admin API hands out is one segment of its own paths and can be read, rotated
/// and revoked through them.
fn key_id(v: &Value) -> Result<String, FieldError> {
    let Some(text) = v.as_str() else {
        return Err(FieldError::new("id", "must be a string"));
    };
    match tollgate_rules::keys::id_problem(text) {
        Some(why) => Err(FieldError::new("id", why)),
        None => Ok(text.to_string()),
    }
}

/// A tenant: 1–64 printable ASCII characters without spaces (it is sent upstream and reads as
/// one word in a log line), and no braces, kept out though bucket names escape them.
fn tenant(v: &Value) -> Result<String, FieldError> {
    let Some(text) = v.as_str() else {
        return Err(FieldError::new("tenant", "must be a string"));
    };
    let n = text.chars().count();
    if n == 0 || n > MAX_TENANT_LEN {
        return Err(FieldError::new(
            "tenant",
            format!("must be 1 to {MAX_TENANT_LEN} characters, not {n}"),
        ));
    }
    if let Some(c) = text.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(FieldError::new(
            "tenant",
            format!("must be printable ASCII without spaces, not {c:?}"),
        ));
    }
    if text.contains(['{', '}']) {
        return Err(FieldError::new(
            "tenant",
            "must not contain braces: the tenant is the hash tag of its buckets' names",
        ));
    }
    Ok(text.to_string())
}

/// A name for people: any text of up to 200 characters without control characters, which
/// would garble a log line or the dashboard.
fn name(v: &Value) -> Result<String, FieldError> {
    let Some(text) = v.as_str() else {
        return Err(FieldError::new("name", "must be a string or null"));
    };
    let n = text.chars().count();
    if n == 0 || n > MAX_NAME_LEN {
        return Err(FieldError::new(
            "name",
            format!("must be 1 to {MAX_NAME_LEN} characters, not {n} (null: no name)"),
        ));
    }
    if text.chars().any(char::is_control) {
        return Err(FieldError::new("name", "must not contain control characters"));
    }
    Ok(text.to_string())
}

/// `{"plan": {"rate": "600/60s", "burst": 100}, ...}`, each rate and burst checked as the
/// rules check a key's numbers.
fn limits(v: &Value) -> Result<BTreeMap<String, Numbers>, FieldError> {
    let Some(obj) = v.as_object() else {
        return Err(FieldError::new(
            "limits",
            "must be an object of limit name → {\"rate\", \"burst\"}",
        ));
    };
    let mut out = BTreeMap::new();
    for (lname, n) in obj {
        let at = format!("limits.{lname}");
        let Some(nums) = n.as_object() else {
            return Err(FieldError::new(at, "must be an object {\"rate\", \"burst\"}"));
        };
        only(nums, &format!("{at}."), &["rate", "burst"])?;
        let rate_text = match nums.get("rate") {
            None => return Err(FieldError::new(format!("{at}.rate"), "missing")),
            Some(r) => r.as_str().ok_or_else(|| {
                FieldError::new(format!("{at}.rate"), "must be a string such as \"600/60s\"")
            })?,
        };
        let burst = match nums.get("burst") {
            None => return Err(FieldError::new(format!("{at}.burst"), "missing")),
            Some(b) => match b.as_u64() {
                Some(b) if b >= 1 => b,
                _ => {
                    return Err(FieldError::new(
                        format!("{at}.burst"),
                        "must be a whole number of at least 1",
                    ));
                }
            },
        };
        let rate = Rate::parse(rate_text).map_err(|e| FieldError::new(format!("{at}.rate"), e))?;
        BucketParams::new(rate, burst).map_err(|e| FieldError::new(&at, e.to_string()))?;
        out.insert(
            lname.clone(),
            Numbers {
                rate: rate_text.to_string(),
                burst,
            },
        );
    }
    Ok(out)
}

fn expiry(v: &Value, now: Timestamp) -> Result<Timestamp, FieldError> {
    let Some(text) = v.as_str() else {
        return Err(FieldError::new(
            "expires_at",
            "must be an RFC 3339 time such as \"2027-01-01T00:00:00Z\", or null",
        ));
    };
    let t: Timestamp = text.parse().map_err(|e| {
        FieldError::new(
            "expires_at",
            format!("{text:?} is not an RFC 3339 time with an offset: {e}"),
        )
    })?;
    if t <= now {
        return Err(FieldError::new(
            "expires_at",
            format!("{t} is not after now ({now})"),
        ));
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Status;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    const NOW: &str = "2026-03-01T12:00:00Z";

    fn field_of(body: &str) -> FieldError {
        Create::parse(body.as_bytes(), at(NOW)).unwrap_err()
    }

    fn plan() -> BTreeMap<String, Numbers> {
        BTreeMap::from([(
            "plan".to_string(),
            Numbers {
                rate: "600/60s".into(),
                burst: 100,
            },
        )])
    }

    #[test]
    fn a_full_create_body_reads() {
        let c = Create::parse(
            br#"{"id": "k-7", "tenant": "acme", "name": "Acme Corp",
                 "limits": {"plan": {"rate": "600/60s", "burst": 100}},
                 "expires_at": "2027-01-01T00:00:00+01:00"}"#,
            at(NOW),
        )
        .unwrap();
        assert_eq!(
            c,
            Create {
                id: Some("k-7".into()),
                tenant: "acme".into(),
                name: Some("Acme Corp".into()),
                limits: plan(),
                expires_at: Some(at("2026-12-31T23:00:00Z")),
            }
        );
        let c = Create::parse(br#"{"tenant": "acme"}"#, at(NOW)).unwrap();
        assert_eq!((c.id, c.limits.len(), c.expires_at), (None, 0, None));
    }

    #[test]
    fn each_bad_create_field_is_named() {
        for (body, field, says) in [
            ("{", "", "not JSON"),
            ("", "", "not JSON"),
            ("[1]", "", "must be a JSON object"),
            (
                r#"{"tenant": "a", "expire_at": "2027-01-01T00:00:00Z"}"#,
                "expire_at",
                "unknown field",
            ),
            (r#"{}"#, "tenant", "missing"),
            (r#"{"tenant": 7}"#, "tenant", "must be a string"),
            (r#"{"tenant": ""}"#, "tenant", "1 to 64"),
            (r#"{"tenant": "a b"}"#, "tenant", "without spaces"),
            (r#"{"tenant": "é"}"#, "tenant", "printable ASCII"),
            (r#"{"tenant": "a{b}"}"#, "tenant", "braces"),
            (r#"{"tenant": "a", "id": ""}"#, "id", "1 to 128"),
            (r#"{"tenant": "a", "id": "k\t7"}"#, "id", "only letters"),
            (r#"{"tenant": "a", "id": "a/b"}"#, "id", "only letters"),
            (r#"{"tenant": "a", "id": "../x"}"#, "id", "only letters"),
            (r#"{"tenant": "a", "id": "q?x"}"#, "id", "only letters"),
            (r#"{"tenant": "a", "id": "a%2Fb"}"#, "id", "only letters"),
            (r#"{"tenant": "a", "id": "k 7"}"#, "id", "only letters"),
            (r#"{"tenant": "a", "id": ".."}"#, "id", "dot segment"),
            (r#"{"tenant": "a", "id": 7}"#, "id", "must be a string"),
            (r#"{"tenant": "a", "name": 3}"#, "name", "string or null"),
            (r#"{"tenant": "a", "name": "x\ny"}"#, "name", "control characters"),
            (r#"{"tenant": "a", "limits": []}"#, "limits", "must be an object"),
            (
                r#"{"tenant": "a", "limits": {"plan": 5}}"#,
                "limits.plan",
                "must be an object",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"burst": 1}}}"#,
                "limits.plan.rate",
                "missing",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"rate": "1/s"}}}"#,
                "limits.plan.burst",
                "missing",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"rate": "fast", "burst": 1}}}"#,
                "limits.plan.rate",
                "must look like",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"rate": "0/1s", "burst": 1}}}"#,
                "limits.plan.rate",
                "above zero",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"rate": 10, "burst": 1}}}"#,
                "limits.plan.rate",
                "must be a string",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"rate": "1/s", "burst": 0}}}"#,
                "limits.plan.burst",
                "at least 1",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"rate": "1/s", "burst": -1}}}"#,
                "limits.plan.burst",
                "at least 1",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"rate": "1/s", "burst": 1.5}}}"#,
                "limits.plan.burst",
                "at least 1",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"rate": "1/s", "burst": 1, "cost": 2}}}"#,
                "limits.plan.cost",
                "unknown field",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"rate": "1/3h", "burst": 1}}}"#,
                "limits.plan",
                "units per token",
            ),
            (
                r#"{"tenant": "a", "limits": {"plan": {"rate": "1/s", "burst": 9007199254740993}}}"#,
                "limits.plan",
                "exact limit",
            ),
            (
                r#"{"tenant": "a", "expires_at": "2027-01-01"}"#,
                "expires_at",
                "RFC 3339",
            ),
            (
                r#"{"tenant": "a", "expires_at": 1790000000}"#,
                "expires_at",
                "RFC 3339",
            ),
            (
                r#"{"tenant": "a", "expires_at": "2026-03-01T12:00:00Z"}"#,
                "expires_at",
                "not after now",
            ),
            (
                r#"{"tenant": "a", "expires_at": "2020-01-01T00:00:00Z"}"#,
                "expires_at",
                "not after now",
            ),
        ] {
            let e = field_of(body);
            assert_eq!(e.field, field, "{body}: {e}");
            assert!(e.reason.contains(says), "{body}: {e}");
        }
        let long = "k".repeat(129);
        let e = field_of(&format!(r#"{{"tenant": "a", "id": "{long}"}}"#));
        assert_eq!(
            (e.field.as_str(), e.reason.contains("not 129")),
            ("id", true),
            "{e}"
        );
        let longest = format!(r#"{{"tenant": "a", "id": "{}"}}"#, "k.-_9".repeat(25) + "abc");
        assert!(Create::parse(longest.as_bytes(), at(NOW)).is_ok());
        assert!(
            Create::parse(
                format!(r#"{{"tenant": "{}"}}"#, "t".repeat(64)).as_bytes(),
                at(NOW)
            )
            .is_ok()
        );
        let e = field_of(&format!(r#"{{"tenant": "a", "name": "{}"}}"#, "n".repeat(201)));
        assert_eq!(e.field, "name");
    }

    #[test]
    fn a_field_error_says_where_and_why() {
        let e = field_of(r#"{"tenant": "a", "limits": {"plan": {"rate": "1/s", "burst": 0}}}"#);
        assert_eq!(
            e.to_string(),
            "limits.plan.burst: must be a whole number of at least 1"
        );
        assert!(field_of("{").to_string().starts_with("the body: not JSON"));
    }

    #[test]
    fn create_makes_an_id_and_a_working_secret() {
        let now = at(NOW);
        let c = Create::parse(
            br#"{"tenant": "acme", "limits": {"plan": {"rate": "600/60s", "burst": 100}}}"#,
            now,
        )
        .unwrap();
        let (rec, secret) = create(c, now);
        assert!(rec.id.starts_with("k_") && rec.id.len() == 14, "{}", rec.id);
        assert!(key_id(&Value::from(rec.id.as_str())).is_ok());
        assert_eq!(
            crate::secret::looks_generated(&secret),
            crate::secret::Verdict::Good
        );
        assert_eq!(rec.status(&crate::secret::hash(&secret), now), Status::Valid);
        assert_eq!((rec.created_at, rec.updated_at), (now, now));
        assert_eq!(rec.limits, plan());
        assert!(!rec.to_json().contains(&secret));
        let (other, _) = create(Create::parse(br#"{"tenant": "acme"}"#, now).unwrap(), now);
        assert_ne!(other.id, rec.id);
    }

    #[test]
    fn rotation_keeps_old_secrets_for_the_grace_only() {
        let t0 = at(NOW);
        let (rec, s0) = create(Create::parse(br#"{"tenant": "a"}"#, t0).unwrap(), t0);
        let t1 = at("2026-03-02T12:00:00Z");
        let (rec, s1) = rotate(&rec, 3_600, t1).unwrap();
        let (h0, h1) = (crate::secret::hash(&s0), crate::secret::hash(&s1));
        assert_eq!(rec.secrets.len(), 2);
        assert_eq!(rec.updated_at, t1);
        assert_eq!(rec.status(&h0, at("2026-03-02T12:59:59Z")), Status::Valid);
        assert_eq!(rec.status(&h0, at("2026-03-02T13:00:00Z")), Status::Expired);
        assert_eq!(rec.status(&h1, at("2026-03-02T13:00:00Z")), Status::Valid);
        // A second rotation with a longer grace does not lengthen the first one's.
        let t2 = at("2026-03-02T12:30:00Z");
        let (rec, s2) = rotate(&rec, 86_400, t2).unwrap();
        assert_eq!(rec.secrets[0].not_after, Some(at("2026-03-02T13:00:00Z")));
        assert_eq!(rec.secrets[1].not_after, Some(at("2026-03-03T12:30:00Z")));
        assert_eq!(rec.status(&crate::secret::hash(&s2), t2), Status::Valid);
        // Grace 0: the old secrets stop at once; the lapsed ones are dropped.
        let t3 = at("2026-03-02T14:00:00Z");
        let (rec, s3) = rotate(&rec, 0, t3).unwrap();
        assert_eq!(rec.secrets.len(), 3, "{:?}", rec.secrets);
        assert_eq!(rec.status(&h0, t3), Status::Unknown);
        assert_eq!(rec.status(&h1, t3), Status::Expired);
        assert_eq!(rec.status(&crate::secret::hash(&s2), t3), Status::Expired);
        assert_eq!(rec.status(&crate::secret::hash(&s3), t3), Status::Valid);
        let (rec, _) = rotate(&rec, 0, at("2026-03-02T14:00:01Z")).unwrap();
        assert_eq!(rec.secrets.len(), 2);
    }

    #[test]
    fn rotation_is_bounded_and_refused_on_a_revoked_key() {
        let t = at(NOW);
        let (mut rec, _) = create(Create::parse(br#"{"tenant": "a"}"#, t).unwrap(), t);
        for _ in 1..MAX_SECRETS {
            rec = rotate(&rec, 60, t).unwrap().0;
        }
        assert_eq!(rec.secrets.len(), MAX_SECRETS);
        assert!(matches!(
            rotate(&rec, 60, t),
            Err(Refusal::TooManySecrets { live: 10, .. })
        ));
        // A rotation that ends the others at once is always allowed: it is the way out.
        let (rec, _) = rotate(&rec, 0, t).unwrap();
        let rec = revoke(&rec, at("2026-03-01T13:00:00Z"));
        assert!(rec.revoked);
        assert_eq!(rec.updated_at, at("2026-03-01T13:00:00Z"));
        assert_eq!(revoke(&rec, at("2026-03-09T00:00:00Z")), rec);
        let e = rotate(&rec, 0, t).unwrap_err();
        assert_eq!(e, Refusal::Revoked { id: rec.id.clone() });
    }

    #[test]
    fn rotate_bodies() {
        assert_eq!(Rotate::parse(br#"{"grace_s": 0}"#), Ok(Rotate { grace_s: 0 }));
        assert_eq!(
            Rotate::parse(br#"{"grace_s": 2592000}"#),
            Ok(Rotate { grace_s: MAX_GRACE_S })
        );
        for (body, field, says) in [
            (r#"{"grace_s": 2592001}"#, "grace_s", "0 to 2592000"),
            (r#"{"grace_s": -1}"#, "grace_s", "whole number"),
            (r#"{"grace_s": "60"}"#, "grace_s", "whole number"),
            (r#"{}"#, "grace_s", "missing"),
            (r#"{"grace_s": 1, "now": true}"#, "now", "unknown field"),
            ("nope", "", "not JSON"),
        ] {
            let e = Rotate::parse(body.as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{body}: {e}");
            assert!(e.reason.contains(says), "{body}: {e}");
        }
    }

    #[test]
    fn patches_change_what_they_name() {
        let t = at(NOW);
        let (rec, _) = create(
            Create::parse(
                br#"{"tenant": "a", "name": "A", "expires_at": "2027-01-01T00:00:00Z",
                     "limits": {"plan": {"rate": "600/60s", "burst": 100}}}"#,
                t,
            )
            .unwrap(),
            t,
        );
        let later = at("2026-03-05T00:00:00Z");
        let p = Patch::parse(br#"{"name": null, "expires_at": null}"#, later).unwrap();
        let r = patch(&rec, p, later).unwrap();
        assert_eq!(
            (r.name.as_deref(), r.expires_at, &r.limits),
            (None, None, &plan())
        );
        assert_eq!(r.updated_at, later);
        let p = Patch::parse(
            br#"{"limits": {"gold": {"rate": "10/1s", "burst": 20}}, "expires_at": "2028-01-01T00:00:00Z"}"#,
            later,
        )
        .unwrap();
        let r = patch(&rec, p, later).unwrap();
        assert_eq!(r.limits.keys().collect::<Vec<_>>(), ["gold"]);
        assert_eq!(r.expires_at, Some(at("2028-01-01T00:00:00Z")));
        assert_eq!(r.name.as_deref(), Some("A"));
        let p = Patch::parse(br#"{"limits": {}}"#, later).unwrap();
        assert!(patch(&rec, p, later).unwrap().limits.is_empty());
        let revoked = revoke(&rec, later);
        let p = Patch::parse(br#"{"name": "B"}"#, later).unwrap();
        assert!(matches!(patch(&revoked, p, later), Err(Refusal::Revoked { .. })));
    }

    #[test]
    fn bad_patch_bodies_are_named() {
        let now = at(NOW);
        for (body, field, says) in [
            (r#"{}"#, "", "changes nothing"),
            (r#"{"tenant": "b"}"#, "tenant", "unknown field"),
            (r#"{"revoked": false}"#, "revoked", "unknown field"),
            (
                r#"{"limits": {"plan": {"rate": "1/s", "burst": 0}}}"#,
                "limits.plan.burst",
                "at least 1",
            ),
            (
                r#"{"expires_at": "2026-02-01T00:00:00Z"}"#,
                "expires_at",
                "not after now",
            ),
            (r#"{"name": ""}"#, "name", "1 to 200"),
            ("7", "", "must be a JSON object"),
        ] {
            let e = Patch::parse(body.as_bytes(), now).unwrap_err();
            assert_eq!(e.field, field, "{body}: {e}");
            assert!(e.reason.contains(says), "{body}: {e}");
        }
    }
}
