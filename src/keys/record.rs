//! One managed API key as kept in a store: its owner, its numbers, its life cycle and the
//! hashes of its secrets, in a stable JSON form; what a presented secret's hash means for it;
//! and the view of it the admin API may show.

use std::collections::BTreeMap;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// A key's own numbers for one limit, written as in a rules file (`{"rate": "600/60s",
/// "burst": 100}`); the gateway compiles them against its rules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Numbers {
    pub rate: String,
    pub burst: u64,
}

/// One secret of a key, known only by its SHA-256. A key holds several while a rotation's
/// grace runs, so clients can move to the new secret before the old one stops working.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Secret {
    #[serde(with = "hex_hash")]
    pub hash: [u8; 32],
    #[serde(with = "rfc3339")]
    pub created_at: Timestamp,
    /// From this instant on the secret no longer works; `None` until a rotation replaces it.
    #[serde(with = "rfc3339_opt", default)]
    pub not_after: Option<Timestamp>,
}

/// A managed key. Stores keep it as [`KeyRecord::to_json`]; unknown fields are ignored when
/// reading, so a gateway of an older version can read what a newer one wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    pub id: String,
    pub tenant: String,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub limits: BTreeMap<String, Numbers>,
    #[serde(with = "rfc3339_opt", default)]
    pub expires_at: Option<Timestamp>,
    #[serde(default)]
    pub revoked: bool,
    pub secrets: Vec<Secret>,
    #[serde(with = "rfc3339")]
    pub created_at: Timestamp,
    #[serde(with = "rfc3339")]
    pub updated_at: Timestamp,
}

/// What a presented secret's hash means for one key at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Valid,
    /// The hash is none of this key's secrets.
    Unknown,
    /// The key is past its `expires_at`, or this secret past its `not_after`.
    Expired,
    Revoked,
}

impl KeyRecord {
    /// Revocation outranks expiry: an operator who revoked a key wants that said, whatever
    /// the dates. A hash the key never had is `Unknown` whatever the key's state, so nothing
    /// about a key is told to a caller who doesn't hold one of its secrets.
    pub fn status(&self, hash: &[u8; 32], now: Timestamp) -> Status {
        let Some(secret) = self.secrets.iter().find(|s| s.hash == *hash) else {
            return Status::Unknown;
        };
        if self.revoked {
            return Status::Revoked;
        }
        let lapsed = |at: Option<Timestamp>| at.is_some_and(|t| now >= t);
        if lapsed(self.expires_at) || lapsed(secret.not_after) {
            return Status::Expired;
        }
        Status::Valid
    }

    /// What the admin API may show of a key: never a hash, since a leaked hash is enough to
    /// write a rules file that accepts the key's secret.
    pub fn public_view(&self) -> serde_json::Value {
        let secrets: Vec<serde_json::Value> = self
            .secrets
            .iter()
            .map(|s| {
                serde_json::json!({
                    "created_at": s.created_at.to_string(),
                    "not_after": s.not_after.map(|t| t.to_string()),
                })
            })
            .collect();
        serde_json::json!({
            "id": self.id,
            "tenant": self.tenant,
            "name": self.name,
            "limits": self.limits,
            "expires_at": self.expires_at.map(|t| t.to_string()),
            "revoked": self.revoked,
            "secrets": secrets,
        })
    }

    /// The stored form.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("strings, numbers and string-keyed maps serialize")
    }

    /// Reads the stored form; the error says what is wrong, the caller says where it was.
    pub fn from_json(text: &str) -> Result<KeyRecord, String> {
        serde_json::from_str(text).map_err(|e| format!("not a key record: {e}"))
    }
}

mod hex_hash {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(h: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(h))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let text = String::deserialize(d)?;
        let mut out = [0u8; 32];
        hex::decode_to_slice(&text, &mut out)
            .map_err(|e| D::Error::custom(format!("hash {text:?} is not 64 hex digits: {e}")))?;
        Ok(out)
    }
}

mod rfc3339 {
    use jiff::Timestamp;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(t: &Timestamp, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(t)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Timestamp, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|e| D::Error::custom(format!("{text:?} is not an RFC 3339 time: {e}")))
    }
}

mod rfc3339_opt {
    use jiff::Timestamp;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(t: &Option<Timestamp>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.collect_str(t),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Timestamp>, D::Error> {
        let Some(text) = Option::<String>::deserialize(d)? else {
            return Ok(None);
        };
        text.parse()
            .map(Some)
            .map_err(|e| D::Error::custom(format!("{text:?} is not an RFC 3339 time: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn record() -> KeyRecord {
        KeyRecord {
            id: "k-7".into(),
            tenant: "acme".into(),
            name: Some("Acme Corp".into()),
            limits: BTreeMap::from([(
                "plan".into(),
                Numbers {
                    rate: "600/60s".into(),
                    burst: 100,
                },
            )]),
            expires_at: Some(at("2027-01-01T00:00:00Z")),
            revoked: false,
            secrets: vec![
                Secret {
                    hash: [1; 32],
                    created_at: at("2026-01-01T00:00:00Z"),
                    not_after: Some(at("2026-02-01T00:00:00Z")),
                },
                Secret {
                    hash: [2; 32],
                    created_at: at("2026-01-31T00:00:00Z"),
                    not_after: None,
                },
            ],
            created_at: at("2026-01-01T00:00:00Z"),
            updated_at: at("2026-01-31T00:00:00Z"),
        }
    }

    #[test]
    fn the_stored_form_is_stable_and_reads_back() {
        let r = record();
        let json = r.to_json();
        assert_eq!(
            json,
            concat!(
                r#"{"id":"k-7","tenant":"acme","name":"Acme Corp","limits":{"plan":{"rate":"600/60s","burst":100}},"#,
                r#""expires_at":"2027-01-01T00:00:00Z","revoked":false,"secrets":["#,
                r#"{"hash":"0101010101010101010101010101010101010101010101010101010101010101","created_at":"2026-01-01T00:00:00Z","not_after":"2026-02-01T00:00:00Z"},"#,
                r#"{"hash":"0202020202020202020202020202020202020202020202020202020202020202","created_at":"2026-01-31T00:00:00Z","not_after":null}],"#,
                r#""created_at":"2026-01-01T00:00:00Z","updated_at":"2026-01-31T00:00:00Z"}"#
            )
        );
        assert_eq!(KeyRecord::from_json(&json).unwrap(), r);
    }

    #[test]
    fn a_newer_writers_fields_are_ignored_and_bad_ones_named() {
        let mut v: serde_json::Value = serde_json::from_str(&record().to_json()).unwrap();
        v["owner_email"] = "ops@example.com".into();
        assert_eq!(KeyRecord::from_json(&v.to_string()).unwrap(), record());
        v["secrets"][0]["hash"] = "zz".into();
        let e = KeyRecord::from_json(&v.to_string()).unwrap_err();
        assert!(e.contains("\"zz\" is not 64 hex digits"), "{e}");
        v["secrets"][0]["hash"] = hex::encode([1; 32]).into();
        v["created_at"] = "yesterday".into();
        let e = KeyRecord::from_json(&v.to_string()).unwrap_err();
        assert!(e.contains("\"yesterday\" is not an RFC 3339 time"), "{e}");
    }

    #[test]
    fn status_of_each_secret_over_time() {
        let r = record();
        let (old, new) = ([1; 32], [2; 32]);
        assert_eq!(r.status(&old, at("2026-01-31T12:00:00Z")), Status::Valid);
        assert_eq!(r.status(&new, at("2026-01-31T12:00:00Z")), Status::Valid);
        // At its not_after exactly, a secret is done: a grace of 0 ends it at once.
        assert_eq!(r.status(&old, at("2026-02-01T00:00:00Z")), Status::Expired);
        assert_eq!(r.status(&new, at("2026-02-01T00:00:00Z")), Status::Valid);
        assert_eq!(r.status(&new, at("2027-01-01T00:00:00Z")), Status::Expired);
        assert_eq!(r.status(&[3; 32], at("2026-01-31T12:00:00Z")), Status::Unknown);
        let revoked = KeyRecord { revoked: true, ..r };
        assert_eq!(revoked.status(&new, at("2026-01-31T12:00:00Z")), Status::Revoked);
        assert_eq!(revoked.status(&old, at("2030-01-01T00:00:00Z")), Status::Revoked);
        assert_eq!(
            revoked.status(&[3; 32], at("2026-01-31T12:00:00Z")),
            Status::Unknown
        );
    }

    #[test]
    fn the_public_view_shows_no_hash() {
        let v = record().public_view();
        assert_eq!(
            v,
            serde_json::json!({
                "id": "k-7",
                "tenant": "acme",
                "name": "Acme Corp",
                "limits": {"plan": {"rate": "600/60s", "burst": 100}},
                "expires_at": "2027-01-01T00:00:00Z",
                "revoked": false,
                "secrets": [
                    {"created_at": "2026-01-01T00:00:00Z", "not_after": "2026-02-01T00:00:00Z"},
                    {"created_at": "2026-01-31T00:00:00Z", "not_after": null},
                ],
            })
        );
        assert!(!v.to_string().contains("0101"));
    }
}
