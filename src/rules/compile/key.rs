//! The `keys` of a rules file, read in a pass of their own (a file may hold millions), with
//! the plans and quotas they name.

use http::HeaderValue;

use crate::compile::{Compiler, Limits, parse_error};

use sha2::{Digest, Sha256};

use crate::Arc;
use crate::Dimension;
use crate::KeysBuilder;
use crate::RawDimension;
use crate::RawDimensionName;
use crate::RawKey;
use crate::RawNumbers;
use crate::RawQuota;
use crate::RawRules;
use crate::RulesError;
use crate::keys;
use crate::quota;

impl Compiler<'_> {
    /// The keys made through the admin API, after the file's and held to the same checks: an
    /// id or a secret the file has, a limit it lacks, numbers a tenant's other keys don't
    /// share are refused, naming `managed_keys[i]`.
    pub(super) fn managed_keys(
        &self,
        raw: &RawRules,
        limits: &Limits,
        keys: &mut KeysBuilder,
    ) -> Result<(), RulesError> {
        if self.managed.is_empty() {
            return Ok(());
        }
        let plan_quota = self.plan_quota(raw)?.map(Arc::new);
        for (i, m) in self.managed.iter().enumerate() {
            let field = KeyAt::Managed(i);
            if keys.len() >= keys::MAX_KEYS {
                return Err(self.err("managed_keys", format!("more than {} keys", keys::MAX_KEYS)));
            }
            let Some(((newest, newest_until), older)) = m.secrets.split_last() else {
                return Err(self.err(format!("{field}.secrets"), format!("key {}: no secret", m.id)));
            };
            let k = RawKey {
                id: m.id.clone(),
                tenant: Some(m.tenant.clone()),
                name: m.name.clone(),
                sha256: hex::encode(newest),
                limits: m
                    .limits
                    .iter()
                    .map(|(l, rate, burst)| {
                        let n = RawNumbers {
                            rate: rate.clone(),
                            burst: *burst,
                        };
                        (l.clone(), n)
                    })
                    .collect(),
                quota: None,
            };
            let hash = self.key_hash(field, &k, keys)?;
            self.key(field, k, hash, limits, keys, plan_quota.as_ref())?;
            keys.set_life(
                m.expires_at.unwrap_or(keys::NEVER),
                newest_until.unwrap_or(keys::NEVER),
                m.revoked,
            );
            for (hash, until) in older {
                if keys.hash_of(hash).is_some() {
                    return Err(self.err(
                        format!("{field}.secrets"),
                        format!("key {}: a secret another key has", m.id),
                    ));
                }
                keys.push_older(*hash, until.unwrap_or(keys::NEVER));
            }
        }
        Ok(())
    }

    /// The keys, read from the file one at a time: each is parsed, checked and compiled before
    /// the next, so the parsed form of one key at most is held, never the whole list.
    pub(super) fn keys(&self, raw: &RawRules, limits: &Limits) -> Result<KeysBuilder, RulesError> {
        let mut pass = KeysPass {
            compiler: self,
            limits,
            plan_quota: self.plan_quota(raw)?.map(Arc::new),
            keys: KeysBuilder::default(),
            failed: None,
        };
        let mut de = serde_json::Deserializer::from_slice(self.bytes);
        let mut track = serde_path_to_error::Track::new();
        let read = serde::de::DeserializeSeed::deserialize(
            &mut pass,
            serde_path_to_error::Deserializer::new(&mut de, &mut track),
        );
        if let Some(e) = pass.failed.take() {
            return Err(e);
        }
        read.map_err(|e| parse_error(self.file, track.path().to_string(), e))?;
        Ok(pass.keys)
    }

    /// A quota set on a limit: the default of every key. Quotas count a key's admitted
    /// requests, so only a `key` limit may carry one, and only one limit, so each key has one.
    pub(super) fn plan_quota(&self, raw: &RawRules) -> Result<Option<quota::Quota>, RulesError> {
        let mut found: Option<(&str, quota::Quota)> = None;
        for (name, l) in &raw.limits {
            let Some(q) = &l.quota else { continue };
            let field = format!("limits.{name}.quota");
            if !matches!(l.dimension, RawDimension::Named(RawDimensionName::Key)) {
                return Err(self.err(
                    field,
                    "only a \"key\" limit may carry a quota: a quota counts each key's requests",
                ));
            }
            if let Some((first, _)) = &found {
                return Err(self.err(
                    field,
                    format!("limits {first:?} and {name:?} both carry a quota; a key has one"),
                ));
            }
            found = Some((name, self.quota(&field, &format!("limit {name}"), q)?));
        }
        Ok(found.map(|(_, q)| q))
    }

    /// A quota as written, checked: the error names the field that is wrong.
    pub(super) fn quota(&self, field: &str, whose: &str, q: &RawQuota) -> Result<quota::Quota, RulesError> {
        let zone = q.timezone.as_deref().unwrap_or("UTC");
        quota::Quota::new(q.per, q.limit, zone).map_err(|e| {
            let part = match e {
                quota::QuotaError::Zone(_) => "timezone",
                quota::QuotaError::Zero => "limit",
            };
            self.err(format!("{field}.{part}"), format!("{whose}: {e}"))
        })
    }

    /// The hash of a key's secret, once its id and its hash are known to be new: a request
    /// finds its key by the hash, and logs and replay name it by the id.
    fn key_hash(&self, field: KeyAt, k: &RawKey, keys: &KeysBuilder) -> Result<[u8; 32], RulesError> {
        // A key made through the admin API before ids kept to the alphabet still compiles, so
        // it keeps working until its owner revokes it through a percent-encoded path.
        let problem = match field {
            KeyAt::File(_) => crate::keys::id_problem(&k.id),
            KeyAt::Managed(_) => k.id.is_empty().then(|| "must not be empty".to_string()),
        };
        if let Some(why) = problem {
            return Err(self.err(format!("{field}.id"), format!("key {:?}: {why}", k.id)));
        }
        if keys.id_of(&k.id).is_some() {
            return Err(self.err(format!("{field}.id"), format!("duplicate key id {:?}", k.id)));
        }
        let hash = parse_sha256(&k.sha256)
            .map_err(|reason| self.err(format!("{field}.sha256"), format!("key {}: {reason}", k.id)))?;
        if let Some(other) = keys.hash_of(&hash) {
            return Err(self.err(
                format!("{field}.sha256"),
                format!(
                    "duplicate key hash: keys {:?} and {:?} have the same secret",
                    keys.keys()[other].id,
                    k.id
                ),
            ));
        }
        Ok(hash)
    }

    /// One key, added to `keys`; keys of one tenant must set the same numbers.
    fn key(
        &self,
        field: KeyAt,
        k: RawKey,
        hash: [u8; 32],
        limits: &Limits,
        keys: &mut KeysBuilder,
        plan_quota: Option<&Arc<quota::Quota>>,
    ) -> Result<(), RulesError> {
        let tenant_text = k.tenant.as_deref().unwrap_or(&k.id);
        if tenant_text.is_empty() || tenant_text.contains(['{', '}']) {
            return Err(self.err(format!("{field}.tenant"), "must be non-empty, without braces"));
        }
        let quota = match &k.quota {
            Some(q) => Some(Arc::new(self.quota(
                &format!("{field}.quota"),
                &format!("key {}", k.id),
                q,
            )?)),
            None => plan_quota.cloned(),
        };
        let run = self.key_limits(field, &k, limits, keys)?;
        // Keys of one tenant share buckets, so they must share numbers.
        let shared = match keys.tenant(tenant_text) {
            Some((_, first)) if keys.run(first) != run.as_slice() => {
                return Err(self.err(
                    format!("{field}.limits"),
                    format!(
                        "keys {:?} and {:?} share tenant {tenant_text:?} but set different limits",
                        &*keys.keys()[first].id,
                        k.id
                    ),
                ));
            }
            Some((name, _)) => Some(name.clone()),
            None => None,
        };
        for (what, text) in [("id", &*k.id), ("tenant", tenant_text)] {
            if HeaderValue::from_str(text).is_err() {
                return Err(self.err(
                    format!("{field}.{what}"),
                    "must be printable ASCII (it is sent upstream)",
                ));
            }
        }
        let id: Arc<str> = k.id.as_str().into();
        let tenant = match (shared, &k.tenant) {
            (Some(name), _) => name,
            // The tenant is the id: one allocation for both.
            (None, None) => id.clone(),
            (None, Some(t)) => t.as_str().into(),
        };
        let name = k.name.map(String::into_boxed_str);
        keys.push(keys::new_key(id, tenant, name, hash, quota), &run);
        Ok(())
    }

    /// A key's own numbers, as (limit index, index of the shared numbers) in limit order:
    /// numbers written alike for one limit are compiled once and shared.
    fn key_limits(
        &self,
        field: KeyAt,
        k: &RawKey,
        limits: &Limits,
        keys: &mut KeysBuilder,
    ) -> Result<Vec<(u16, u32)>, RulesError> {
        let mut run = Vec::with_capacity(k.limits.len());
        for (lname, RawNumbers { rate, burst }) in &k.limits {
            let lfield = || format!("{field}.limits.{lname}");
            let Some(&li) = limits.by_name.get(lname.as_str()) else {
                return Err(self.err(lfield(), format!("no limit named {lname:?}")));
            };
            let limit = &limits.list[li];
            if limit.dimension == Dimension::Ip {
                return Err(self.err(lfield(), "ip limits are per address and can't be set per key"));
            }
            let n = match keys.written(li as u16, rate, *burst) {
                keys::Written::Known(n) => n,
                keys::Written::New => {
                    let n = self.numbers(&lfield(), lname, rate, *burst)?;
                    if let Some(block) = limit.lease {
                        self.check_leasable(&lfield(), &n.params, block)?;
                    }
                    keys.add_numbers(li as u16, rate, *burst, n)
                }
            };
            run.push((li as u16, n));
        }
        Ok(run)
    }
}

/// The second pass over a rules file: its `keys`, each compiled as soon as it is parsed.
struct KeysPass<'p, 'a, 'r> {
    compiler: &'p Compiler<'a>,
    limits: &'p Limits<'r>,
    /// The quota of a key that names none, shared.
    plan_quota: Option<Arc<quota::Quota>>,
    keys: KeysBuilder,
    /// Why the pass stopped, when a key parsed but is not valid.
    failed: Option<RulesError>,
}

/// The field of a key, written out only in an error: the file's `keys[i]`, or
/// `managed_keys[i]` for the i-th key made through the admin API.
#[derive(Clone, Copy)]
enum KeyAt {
    File(usize),
    Managed(usize),
}

impl std::fmt::Display for KeyAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyAt::File(i) => write!(f, "keys[{i}]"),
            KeyAt::Managed(i) => write!(f, "managed_keys[{i}]"),
        }
    }
}

impl KeysPass<'_, '_, '_> {
    fn add(&mut self, k: RawKey) -> Result<(), RulesError> {
        let c = self.compiler;
        let i = self.keys.len();
        if i >= keys::MAX_KEYS {
            return Err(c.err("keys", format!("more than {} keys", keys::MAX_KEYS)));
        }
        let field = KeyAt::File(i);
        let hash = c.key_hash(field, &k, &self.keys)?;
        c.key(
            field,
            k,
            hash,
            self.limits,
            &mut self.keys,
            self.plan_quota.as_ref(),
        )
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for &mut KeysPass<'_, '_, '_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for &mut KeysPass<'_, '_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("the rules object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        // The first pass has checked every field but the keys' contents.
        while let Some(field) = map.next_key::<String>()? {
            if field == "keys" {
                map.next_value_seed(KeyList(&mut *self))?;
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// The `keys` array of [`KeysPass`].
struct KeyList<'x, 'p, 'a, 'r>(&'x mut KeysPass<'p, 'a, 'r>);

impl<'de> serde::de::DeserializeSeed<'de> for KeyList<'_, '_, '_, '_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for KeyList<'_, '_, '_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(k) = seq.next_element::<RawKey>()? {
            if let Err(e) = self.0.add(k) {
                self.0.failed = Some(e);
                return Err(serde::de::Error::custom("an invalid key"));
            }
        }
        Ok(())
    }
}

fn parse_sha256(text: &str) -> Result<[u8; 32], String> {
    if text.len() != 64
        || !text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(format!(
            "{text:?} is not 64 lower-case hex digits (the SHA-256 of the key)"
        ));
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(text, &mut out).map_err(|e| e.to_string())?;
    Ok(out)
}

/// The SHA-256 of a presented secret: the only form in which keys are compared.
pub fn hash_secret(secret: &[u8]) -> [u8; 32] {
    Sha256::digest(secret).into()
}

#[cfg(test)]
mod tests {
    use super::super::testing::{base, err, ok, with_managed};
    use super::hash_secret;
    use crate::{KeyCheck, ManagedKey};

    const ABC: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    #[test]
    fn a_secret_hashes_to_its_sha256() {
        let hex: String = hash_secret(b"abc").iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, ABC);
    }

    #[test]
    fn keys_compile_and_a_duplicate_id_is_refused() {
        let mut rules = base();
        rules["keys"] = serde_json::json!([{"id": "k-1", "sha256": ABC}]);
        assert_eq!(ok(&rules).keys.len(), 1);
        rules["keys"] = serde_json::json!([{"id": "k-1", "sha256": ABC}, {"id": "k-1", "sha256": ABC}]);
        let e = err(&rules);
        assert_eq!(e.field, "keys[1].id", "{e}");
        assert!(e.reason.contains("duplicate key id"), "{e}");
    }

    #[test]
    fn a_hash_that_is_not_hex_is_refused_by_field() {
        let mut rules = base();
        rules["keys"] = serde_json::json!([{"id": "k-1", "sha256": "not-a-hash"}]);
        let e = err(&rules);
        assert_eq!(e.field, "keys[0].sha256", "{e}");
    }

    #[test]
    fn a_file_key_id_keeps_to_the_path_alphabet() {
        for (id, says) in [
            ("", "1 to 128"),
            ("a/b", "only letters"),
            ("../x", "only letters"),
            ("q?x", "only letters"),
            ("a:b", "only letters"),
            ("..", "dot segment"),
        ] {
            let mut rules = base();
            rules["keys"] = serde_json::json!([{"id": id, "sha256": ABC}]);
            let e = err(&rules);
            assert_eq!(e.field, "keys[0].id", "{id}: {e}");
            assert!(e.reason.contains(says), "{id}: {e}");
        }
        let mut rules = base();
        rules["keys"] = serde_json::json!([{"id": "K_7.v-2", "sha256": ABC}]);
        ok(&rules);
    }

    #[test]
    fn a_managed_key_stored_with_an_old_id_still_compiles() {
        let snap = with_managed(&base(), &[managed("a/b?c", &[("s1", None)])]).unwrap();
        assert!(snap.keys.by_id("a/b?c").is_some());
    }

    fn managed(id: &str, secrets: &[(&str, Option<u64>)]) -> ManagedKey {
        ManagedKey {
            id: id.into(),
            tenant: format!("t-{id}"),
            name: None,
            limits: vec![("per_key".to_string(), "5/1s".to_string(), 5)],
            secrets: secrets
                .iter()
                .map(|(s, until)| (hash_secret(s.as_bytes()), *until))
                .collect(),
            expires_at: None,
            revoked: false,
        }
    }

    #[test]
    fn managed_keys_follow_the_files_and_keep_their_life() {
        let mut rules = base();
        rules["keys"] = serde_json::json!([{"id": "k-1", "sha256": ABC}]);
        let mut m = managed("m-1", &[("old", Some(1_000)), ("new", None)]);
        m.expires_at = Some(5_000);
        let snap = with_managed(&rules, &[m]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(snap.keys.len(), 2);
        let k = snap.key_by_id("m-1").unwrap();
        assert!(snap.keys[k].managed && !snap.keys[0].managed);
        let per_key = snap.limits.iter().position(|l| &*l.name == "per_key").unwrap();
        assert_eq!(snap.keys.own_numbers(k, per_key).unwrap().params.burst, 5);
        assert_eq!(
            snap.keys.check(&hash_secret(b"old"), || 999),
            Some(KeyCheck::Valid(k))
        );
        assert_eq!(
            snap.keys.check(&hash_secret(b"old"), || 1_000),
            Some(KeyCheck::Expired(k))
        );
        assert_eq!(
            snap.keys.check(&hash_secret(b"new"), || 4_999),
            Some(KeyCheck::Valid(k))
        );
        assert_eq!(
            snap.keys.check(&hash_secret(b"new"), || 5_000),
            Some(KeyCheck::Expired(k))
        );
        assert_eq!(
            snap.keys.check(&hash_secret(b"abc"), || 0),
            Some(KeyCheck::Valid(0))
        );
    }

    #[test]
    fn a_managed_key_is_held_to_the_files_checks_by_its_own_field() {
        let mut rules = base();
        rules["keys"] = serde_json::json!([{"id": "k-1", "sha256": ABC}]);
        let cases: Vec<(ManagedKey, &str, &str)> = vec![
            (
                managed("k-1", &[("x", None)]),
                "managed_keys[0].id",
                "duplicate key id",
            ),
            (
                managed("m-1", &[("abc", None)]),
                "managed_keys[0].sha256",
                "same secret",
            ),
            (
                managed("m-1", &[("abc", Some(9)), ("y", None)]),
                "managed_keys[0].secrets",
                "another key",
            ),
            (managed("m-1", &[]), "managed_keys[0].secrets", "no secret"),
            (
                ManagedKey {
                    limits: vec![("nope".to_string(), "5/1s".to_string(), 5)],
                    ..managed("m-1", &[("x", None)])
                },
                "managed_keys[0].limits.nope",
                "no limit named",
            ),
            (
                ManagedKey {
                    limits: vec![("per_key".to_string(), "0/1s".to_string(), 5)],
                    ..managed("m-1", &[("x", None)])
                },
                "managed_keys[0].limits.per_key.rate",
                "",
            ),
        ];
        for (m, field, reason) in cases {
            let e = with_managed(&rules, &[m]).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.reason.contains(reason), "{e}");
        }
    }

    #[test]
    fn a_managed_key_whose_burst_a_route_outgrows_is_named_by_its_own_field() {
        let mut rules = base();
        rules["routes"][0]["cost"]["per_key"] = serde_json::json!(5);
        let mut m = managed("m-1", &[("x", None)]);
        m.limits = vec![("per_key".to_string(), "5/1s".to_string(), 3)];
        let e = with_managed(&rules, &[m]).unwrap_err();
        assert_eq!(e.field, "managed_keys[0].limits.per_key.burst", "{e}");
        assert!(e.reason.contains("could never pass"), "{e}");
    }
}
