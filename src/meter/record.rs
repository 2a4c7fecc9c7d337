//! One usage record: what a gateway identity has admitted for one key since it started, or
//! the mark that the identity ended cleanly.

use std::fmt;

/// The Redis stream every gateway appends its records to.
pub(crate) const STREAM: &str = "tollgate:usage";

/// Who counted: the gateway's instance name and the boot id it made at start. A restarted
/// gateway is a new identity, so its totals and sequence start again from nothing.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    pub gateway: String,
    pub boot: String,
}

impl Identity {
    /// An identity for this start of `gateway`, with a fresh random boot id.
    pub fn new(gateway: impl Into<String>) -> Identity {
        Identity {
            gateway: gateway.into(),
            boot: format!("{:016x}", rand::random::<u64>()),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.gateway, self.boot)
    }
}

/// What a record says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// `key`'s running total for this identity.
    Usage { key: String, total: u64 },
    /// The identity stopped cleanly; nothing of it is missing.
    End,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub identity: Identity,
    /// Per identity, from 1, one more for every record it writes.
    pub seq: u64,
    pub kind: Kind,
}

/// A stream entry that is not a record this version can read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("usage record: field {field}: {reason}")]
pub struct RecordError {
    pub field: &'static str,
    pub reason: String,
}

impl Record {
    /// The fields as written to the stream (`XADD … gateway G boot B seq N kind usage key K
    /// total T`); an end record has no key or total.
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        let mut f = vec![
            ("gateway", self.identity.gateway.clone()),
            ("boot", self.identity.boot.clone()),
            ("seq", self.seq.to_string()),
        ];
        match &self.kind {
            Kind::Usage { key, total } => {
                f.push(("kind", "usage".into()));
                f.push(("key", key.clone()));
                f.push(("total", total.to_string()));
            }
            Kind::End => f.push(("kind", "end".into())),
        }
        f
    }

    /// Reads the fields of one stream entry, in any order.
    pub fn from_fields<'a>(
        fields: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Record, RecordError> {
        let (mut gateway, mut boot, mut seq, mut kind, mut key, mut total) =
            (None, None, None, None, None, None);
        for (name, value) in fields {
            match name {
                "gateway" => gateway = Some(value),
                "boot" => boot = Some(value),
                "seq" => seq = Some(value),
                "kind" => kind = Some(value),
                "key" => key = Some(value),
                "total" => total = Some(value),
                _ => {}
            }
        }
        let need = |field: &'static str, v: Option<&'a str>| {
            v.filter(|s| !s.is_empty()).ok_or(RecordError {
                field,
                reason: "missing".into(),
            })
        };
        let number = |field: &'static str, v: Option<&'a str>| -> Result<u64, RecordError> {
            need(field, v)?.parse().map_err(|e| RecordError {
                field,
                reason: format!("not a whole number: {e}"),
            })
        };
        let identity = Identity {
            gateway: need("gateway", gateway)?.to_string(),
            boot: need("boot", boot)?.to_string(),
        };
        let seq = number("seq", seq)?;
        let kind = match need("kind", kind)? {
            "usage" => Kind::Usage {
                key: need("key", key)?.to_string(),
                total: number("total", total)?,
            },
            "end" => Kind::End,
            other => {
                return Err(RecordError {
                    field: "kind",
                    reason: format!("{other:?} is neither usage nor end"),
                });
            }
        };
        Ok(Record { identity, seq, kind })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_read_back_to_the_same_record() {
        let id = Identity::new("gw-1");
        for kind in [
            Kind::Usage {
                key: "k-7".into(),
                total: 100,
            },
            Kind::End,
        ] {
            let r = Record {
                identity: id.clone(),
                seq: 3,
                kind,
            };
            let fields = r.fields();
            let back = Record::from_fields(fields.iter().map(|(n, v)| (*n, v.as_str()))).unwrap();
            assert_eq!(back, r);
        }
    }

    #[test]
    fn a_bad_entry_names_its_field() {
        let e = Record::from_fields([("gateway", "g"), ("boot", "b"), ("seq", "x"), ("kind", "end")])
            .unwrap_err();
        assert_eq!(e.field, "seq");
        let e = Record::from_fields([("gateway", "g"), ("boot", "b"), ("seq", "1"), ("kind", "usage")])
            .unwrap_err();
        assert_eq!(e.field, "key");
    }
}
