//! The managed keys a gateway holds in memory, found by a presented secret's hash: built from
//! [`KeyStore::load_all`](crate::store::KeyStore::load_all) and brought up to date with each
//! answer of [`KeyStore::changes_since`](crate::store::KeyStore::changes_since).

use std::collections::HashMap;
use std::sync::Arc;

use jiff::Timestamp;

use crate::record::{KeyRecord, Status};

/// Keys by id and by the hash of each of their secrets. Cloning shares the records, so a
/// gateway can change a copy and swap it in whole while requests read the old one.
#[derive(Debug, Clone, Default)]
pub struct Keyring {
    generation: u64,
    by_id: HashMap<String, Arc<KeyRecord>>,
    by_hash: HashMap<[u8; 32], Arc<KeyRecord>>,
}

impl Keyring {
    pub fn new(generation: u64, records: Vec<KeyRecord>) -> Keyring {
        let mut ring = Keyring::default();
        ring.apply(generation, records);
        ring
    }

    /// The generation to ask for changes from.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Replaces each record's key by its id: the secrets it no longer has stop finding it.
    pub fn apply(&mut self, generation: u64, records: Vec<KeyRecord>) {
        for rec in records {
            let rec = Arc::new(rec);
            if let Some(old) = self.by_id.insert(rec.id.clone(), rec.clone()) {
                for s in &old.secrets {
                    // Only if it still points at this key: the hash can't be another's unless
                    // copied by hand, and then the newer write should win.
                    if self.by_hash.get(&s.hash).is_some_and(|k| k.id == old.id) {
                        self.by_hash.remove(&s.hash);
                    }
                }
            }
            for s in &rec.secrets {
                self.by_hash.insert(s.hash, rec.clone());
            }
        }
        self.generation = self.generation.max(generation);
    }

    /// The key a secret's hash belongs to, and what the hash means for it now; `None` when
    /// no managed key has it (it may still be a key of the rules file).
    pub fn check(&self, hash: &[u8; 32], now: Timestamp) -> Option<(&Arc<KeyRecord>, Status)> {
        let rec = self.by_hash.get(hash)?;
        Some((rec, rec.status(hash, now)))
    }

    pub fn get(&self, id: &str) -> Option<&Arc<KeyRecord>> {
        self.by_id.get(id)
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub fn records(&self) -> impl Iterator<Item = &Arc<KeyRecord>> {
        self.by_id.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change::{Create, create, revoke, rotate};
    use crate::secret::hash;

    #[test]
    fn changes_replace_keys_and_their_secrets() {
        let t0: Timestamp = "2026-03-01T12:00:00Z".parse().unwrap();
        let (a, sa) = create(Create::parse(br#"{"id": "k-a", "tenant": "t"}"#, t0).unwrap(), t0);
        let (b, sb) = create(Create::parse(br#"{"id": "k-b", "tenant": "t"}"#, t0).unwrap(), t0);
        let mut ring = Keyring::new(2, vec![a.clone(), b.clone()]);
        assert_eq!(ring.len(), 2);
        assert_eq!(
            ring.check(&hash(&sa), t0).map(|(r, s)| (r.id.as_str(), s)),
            Some(("k-a", Status::Valid))
        );
        assert!(ring.check(&[0; 32], t0).is_none());

        let (a2, sa2) = rotate(&a, 0, t0).unwrap();
        ring.apply(3, vec![a2]);
        assert_eq!(ring.generation(), 3);
        assert_eq!(ring.check(&hash(&sa), t0).map(|(_, s)| s), Some(Status::Expired));
        assert_eq!(ring.check(&hash(&sa2), t0).map(|(_, s)| s), Some(Status::Valid));

        // A later rotation drops the lapsed secret from the record, and so from the ring.
        let a3 = rotate(
            ring.get("k-a").unwrap(),
            0,
            "2026-03-01T12:00:01Z".parse().unwrap(),
        )
        .unwrap()
        .0;
        ring.apply(4, vec![a3]);
        assert!(ring.check(&hash(&sa), t0).is_none());

        ring.apply(5, vec![revoke(&b, t0)]);
        assert_eq!(ring.check(&hash(&sb), t0).map(|(_, s)| s), Some(Status::Revoked));
        // An answer read before a later one never moves the generation back.
        ring.apply(4, vec![]);
        assert_eq!(ring.generation(), 5);
        assert_eq!(ring.records().count(), 2);
    }
}
