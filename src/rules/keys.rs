//! The compiled API keys, kept small enough for files of a million keys: one fixed-size entry
//! per key, the numbers keys set shared by every key that writes the same, and the indexes by
//! secret hash and by id as arrays of positions rather than maps of copies.

use std::ops::Index;
use std::sync::Arc;

use http::HeaderValue;

use crate::quota::Quota;
use crate::{Limit, Numbers};

/// One API key of the rules.
#[derive(Debug)]
pub struct ApiKey {
    /// The public id (`k-7`): logs, traces and replay name keys by it.
    pub id: Arc<str>,
    /// Shared by the keys of one tenant (the id's own when the key names none).
    pub tenant: Arc<str>,
    pub name: Option<Box<str>>,
    /// The SHA-256 of the secret: the only form in which keys are compared.
    pub hash: [u8; 32],
    /// The key's billing quota: counted by metering, enforced from its flags. Shared by every
    /// key that carries the limit's default.
    pub quota: Option<Arc<Quota>>,
    /// Its own numbers: `Keys::overrides[at..at + len]`.
    overrides_at: u32,
    overrides_len: u32,
}

impl ApiKey {
    /// The first 8 hex digits of the secret's SHA-256, the most of it that logs may show.
    pub fn hash_prefix(&self) -> String {
        hex::encode(&self.hash[..4])
    }

    /// `X-Tollgate-Key-Id` for the upstream.
    pub fn id_header(&self) -> HeaderValue {
        header(&self.id)
    }

    /// `X-Tollgate-Tenant` for the upstream.
    pub fn tenant_header(&self) -> HeaderValue {
        header(&self.tenant)
    }
}

/// Made per request rather than kept: two header values a key were 150 bytes of a key's
/// memory, and making one is a copy of a few bytes.
fn header(text: &str) -> HeaderValue {
    HeaderValue::from_str(text).expect("key ids and tenants are checked printable ASCII at load")
}

/// Every key of the rules, in file order.
#[derive(Debug, Default)]
pub struct Keys {
    list: Vec<ApiKey>,
    /// (limit index, index in `numbers`): each key's run, in limit order.
    overrides: Vec<(u16, u32)>,
    /// The distinct numbers keys set, one per limit and numbers as written.
    numbers: Vec<Numbers>,
    by_hash: HashIndex,
    /// Positions in `list`, sorted by id.
    by_id: Vec<u32>,
}

impl Keys {
    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn iter(&self) -> std::slice::Iter<'_, ApiKey> {
        self.list.iter()
    }

    /// The numbers a bucket of `limit` (index `idx`) uses for key `k`: its own, else the
    /// limit's.
    pub fn numbers<'a>(&'a self, k: usize, limit: &'a Limit, idx: usize) -> Option<&'a Numbers> {
        self.own_numbers(k, idx).or(limit.numbers.as_ref())
    }

    /// The numbers key `k` sets for limit `idx` itself, if any.
    pub fn own_numbers(&self, k: usize, idx: usize) -> Option<&Numbers> {
        self.run(k)
            .iter()
            .find(|&&(l, _)| l as usize == idx)
            .map(|&(_, n)| &self.numbers[n as usize])
    }

    fn run(&self, k: usize) -> &[(u16, u32)] {
        let key = &self.list[k];
        &self.overrides[key.overrides_at as usize..][..key.overrides_len as usize]
    }

    /// The key whose secret hashes to `digest`.
    pub fn by_hash(&self, digest: &[u8; 32]) -> Option<usize> {
        self.by_hash.get(&self.list, digest)
    }

    /// The key with this public id.
    pub fn by_id(&self, id: &str) -> Option<usize> {
        self.by_id
            .binary_search_by(|&i| (*self.list[i as usize].id).cmp(id))
            .ok()
            .map(|p| self.by_id[p] as usize)
    }
}

impl Index<usize> for Keys {
    type Output = ApiKey;

    fn index(&self, k: usize) -> &ApiKey {
        &self.list[k]
    }
}

impl<'a> IntoIterator for &'a Keys {
    type Item = &'a ApiKey;
    type IntoIter = std::slice::Iter<'a, ApiKey>;

    fn into_iter(self) -> Self::IntoIter {
        self.list.iter()
    }
}

const EMPTY: u32 = u32::MAX;

/// Positions of keys by their secret's hash: open addressing with linear probing, at most half
/// full. A SHA-256 is already uniform, so its first bytes are the slot. Four bytes a slot where
/// a map of the hash to the position held forty.
#[derive(Debug, Default)]
struct HashIndex {
    slots: Box<[u32]>,
}

impl HashIndex {
    fn build(list: &[ApiKey]) -> HashIndex {
        let mut slots = vec![EMPTY; (list.len() * 2).next_power_of_two()].into_boxed_slice();
        let mask = slots.len() - 1;
        for (i, k) in list.iter().enumerate() {
            let mut s = slot(&k.hash) & mask;
            while slots[s] != EMPTY {
                s = (s + 1) & mask;
            }
            slots[s] = i as u32;
        }
        HashIndex { slots }
    }

    fn get(&self, list: &[ApiKey], digest: &[u8; 32]) -> Option<usize> {
        let mask = self.slots.len().checked_sub(1)?;
        let mut s = slot(digest) & mask;
        // The table is never full, so the probe ends at an empty slot.
        loop {
            let i = self.slots[s];
            if i == EMPTY {
                return None;
            }
            if list[i as usize].hash == *digest {
                return Some(i as usize);
            }
            s = (s + 1) & mask;
        }
    }
}

fn slot(hash: &[u8; 32]) -> usize {
    let mut b = [0u8; 8];
    b.copy_from_slice(&hash[..8]);
    u64::from_le_bytes(b) as usize
}

/// The most keys a file may hold: positions are `u32`, and `u32::MAX` marks an empty slot.
pub(crate) const MAX_KEYS: usize = (u32::MAX - 1) as usize;

/// A map that lives only while a file compiles. Its keys come from the operator's own file, not
/// from clients, so a fast hash serves: SipHash was an eighth of a 100,000-key compile.
type BuildMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Keys as compilation adds them, with what checking the next one needs: the ids and hashes
/// seen, the first key of each tenant, and the numbers already written.
#[derive(Default)]
pub(crate) struct KeysBuilder {
    keys: Keys,
    hashes: BuildMap<[u8; 32], u32>,
    ids: BuildMap<Arc<str>, u32>,
    /// Each tenant's shared name and first key.
    tenants: BuildMap<Arc<str>, u32>,
    /// Numbers by (limit, rate as written, burst): the index in `keys.numbers`.
    written: BuildMap<(u16, String, u64), u32>,
    /// For each of `keys.numbers`: its limit and the first key that wrote it.
    written_by: Vec<(u16, u32)>,
}

/// What a key's own numbers are, found or new.
pub(crate) enum Written {
    Known(u32),
    New,
}

impl KeysBuilder {
    pub(crate) fn keys(&self) -> &Keys {
        &self.keys
    }

    pub(crate) fn len(&self) -> usize {
        self.keys.list.len()
    }

    pub(crate) fn id_of(&self, id: &str) -> Option<usize> {
        self.ids.get(id).map(|&i| i as usize)
    }

    pub(crate) fn hash_of(&self, hash: &[u8; 32]) -> Option<usize> {
        self.hashes.get(hash).map(|&i| i as usize)
    }

    /// The tenant's shared name and its first key, when a key named it before.
    pub(crate) fn tenant(&self, tenant: &str) -> Option<(&Arc<str>, usize)> {
        self.tenants
            .get_key_value(tenant)
            .map(|(name, &first)| (name, first as usize))
    }

    /// The numbers key `k` wrote for itself, as (limit, shared index) in limit order.
    pub(crate) fn run(&self, k: usize) -> &[(u16, u32)] {
        self.keys.run(k)
    }

    /// Numbers already written for `limit` as `rate` and `burst` by an earlier key.
    pub(crate) fn written(&self, limit: u16, rate: &str, burst: u64) -> Written {
        // The map's key owns its text; a lookup by borrowed parts would need a key type of its
        // own, and this runs once per key and limit at load.
        match self.written.get(&(limit, rate.to_string(), burst)) {
            Some(&n) => Written::Known(n),
            None => Written::New,
        }
    }

    /// Adds numbers first written by key `by` (the next key's position).
    pub(crate) fn add_numbers(&mut self, limit: u16, rate: &str, burst: u64, n: Numbers) -> u32 {
        let at = self.keys.numbers.len() as u32;
        self.keys.numbers.push(n);
        self.written_by.push((limit, self.len() as u32));
        self.written.insert((limit, rate.to_string(), burst), at);
        at
    }

    /// Appends a key whose own numbers are `run` (limit order). The caller has checked that
    /// its id and hash are new.
    pub(crate) fn push(&mut self, mut key: ApiKey, run: &[(u16, u32)]) {
        let at = self.len() as u32;
        key.overrides_at = self.keys.overrides.len() as u32;
        key.overrides_len = run.len() as u32;
        self.keys.overrides.extend_from_slice(run);
        self.hashes.insert(key.hash, at);
        self.ids.insert(key.id.clone(), at);
        self.tenants.entry(key.tenant.clone()).or_insert(at);
        self.keys.list.push(key);
    }

    /// Every distinct numbers keys wrote, with its limit and the first key that wrote it.
    pub(crate) fn numbers_mut(&mut self) -> impl Iterator<Item = (u16, usize, &mut Numbers)> {
        self.keys
            .numbers
            .iter_mut()
            .zip(&self.written_by)
            .map(|(n, &(l, k))| (l, k as usize, n))
    }

    /// The keys with their indexes; what compiling needed is dropped.
    pub(crate) fn finish(self) -> Keys {
        let mut keys = self.keys;
        drop((self.hashes, self.ids, self.tenants, self.written));
        keys.list.shrink_to_fit();
        keys.overrides.shrink_to_fit();
        keys.numbers.shrink_to_fit();
        keys.by_hash = HashIndex::build(&keys.list);
        let mut by_id: Vec<u32> = (0..keys.list.len() as u32).collect();
        by_id.sort_unstable_by(|&a, &b| keys.list[a as usize].id.cmp(&keys.list[b as usize].id));
        keys.by_id = by_id;
        keys
    }
}

/// A key as compiled, before its place among the others.
pub(crate) fn new_key(
    id: Arc<str>,
    tenant: Arc<str>,
    name: Option<Box<str>>,
    hash: [u8; 32],
    quota: Option<Arc<Quota>>,
) -> ApiKey {
    ApiKey {
        id,
        tenant,
        name,
        hash,
        quota,
        overrides_at: 0,
        overrides_len: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str, hash: [u8; 32]) -> ApiKey {
        new_key(id.into(), id.into(), None, hash, None)
    }

    #[test]
    fn finds_every_key_by_hash_and_id_and_nothing_else() {
        let mut b = KeysBuilder::default();
        let n = 5000u32;
        for i in 0..n {
            let h = crate::hash_secret(format!("s{i}").as_bytes());
            b.push(key(&format!("k-{i}"), h), &[]);
        }
        // Two hashes that share their first eight bytes land in one probe sequence.
        let mut twin = crate::hash_secret(b"s0");
        twin[31] ^= 1;
        b.push(key("twin", twin), &[]);
        let keys = b.finish();
        for i in 0..n as usize {
            assert_eq!(
                keys.by_hash(&crate::hash_secret(format!("s{i}").as_bytes())),
                Some(i)
            );
            assert_eq!(keys.by_id(&format!("k-{i}")), Some(i));
        }
        assert_eq!(keys.by_hash(&twin), Some(n as usize));
        assert_eq!(keys.by_id("twin"), Some(n as usize));
        assert_eq!(keys.by_hash(&crate::hash_secret(b"not a key")), None);
        assert_eq!(keys.by_id("k-x"), None);
    }

    #[test]
    fn no_keys_finds_nothing() {
        let keys = KeysBuilder::default().finish();
        assert_eq!(keys.by_hash(&[0; 32]), None);
        assert_eq!(keys.by_id("k-1"), None);
    }
}
