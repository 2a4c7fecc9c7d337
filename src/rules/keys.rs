//! The compiled API keys, kept small enough for files of a million keys: one fixed-size entry
//! per key, the numbers keys set shared by every key that writes the same, and the indexes by
//! secret hash and by id as arrays of positions rather than maps of copies.

use std::ops::Index;
use std::sync::Arc;

use http::HeaderValue;

use crate::quota::Quota;
use crate::{Limit, Numbers};

/// The longest key id, in characters.
pub const MAX_ID_LEN: usize = 128;

/// Why `id` can't be a key id, or `None` when it can. An id is 1 to [`MAX_ID_LEN`] letters,
/// digits, `-`, `_` and `.`, and not dots alone: it must be one segment of an admin API path
/// as written (`/admin/keys/ID/revoke`), so that every key made can be read, rotated and
/// revoked, and it goes into log lines and upstream headers without escaping.
pub fn id_problem(id: &str) -> Option<String> {
    let n = id.chars().count();
    if n == 0 || n > MAX_ID_LEN {
        return Some(format!("must be 1 to {MAX_ID_LEN} characters, not {n}"));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Some(format!(
            "may hold only letters, digits, '-', '_' and '.', not {c:?}: it is a segment of the admin API's paths"
        ));
    }
    if id.bytes().all(|b| b == b'.') {
        return Some(format!("{id:?} is a path's dot segment, which clients rewrite"));
    }
    None
}

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
    /// The Unix second the key stops working ([`NEVER`] for none): keys made through the admin
    /// API may expire; a rules file's never do.
    expires_s: u64,
    /// The Unix second its secret `hash` stops working ([`NEVER`] for none).
    hash_until_s: u64,
    /// Revoked through the admin API: its secrets are refused as revoked, not unknown.
    revoked: bool,
    /// Made through the admin API rather than written in the rules file.
    pub managed: bool,
}

/// A key made through the admin API rather than written in the rules file, as the compiler
/// takes it: the same checks apply, and its life (expiry, older secrets, revocation) with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagedKey {
    pub id: String,
    pub tenant: String,
    pub name: Option<String>,
    /// Its own numbers: (limit name, rate as written, `600/60s`, burst), a limit at most once.
    /// A list, not a map: a map's node is most of a key's memory when it holds one limit.
    pub limits: Vec<(String, String, u64)>,
    /// The SHA-256 of each of its secrets, newest last, with the Unix second it stops working.
    pub secrets: Vec<([u8; 32], Option<u64>)>,
    /// The Unix second the key stops working.
    pub expires_at: Option<u64>,
    pub revoked: bool,
}

/// No end: a key or secret that never expires.
pub const NEVER: u64 = u64::MAX;

/// What a presented secret's hash finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyCheck {
    /// Key `k`, usable now.
    Valid(usize),
    /// Key `k`, past its own expiry or this secret's end (a rotated-out secret's grace).
    Expired(usize),
    /// Key `k`, revoked.
    Revoked(usize),
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

/// A secret a key had before its newest, kept until its grace ends.
#[derive(Debug)]
struct Older {
    hash: [u8; 32],
    key: u32,
    until_s: u64,
}

/// Every key of the rules, in file order, then the keys made through the admin API.
#[derive(Debug, Default)]
pub struct Keys {
    list: Vec<ApiKey>,
    /// Rotated-out secrets still in their grace: positions past `list` in `by_hash`.
    older: Vec<Older>,
    /// (limit index, index in `numbers`): each key's run, in limit order.
    overrides: Vec<(u16, u32)>,
    /// The distinct numbers keys set, one per limit and numbers as written.
    numbers: Vec<Numbers>,
    /// Each of `numbers` as written (rate, burst): what gives an API key's limits back.
    written: Vec<(Box<str>, u64)>,
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

    /// The key whose secret hashes to `digest`, whatever its state.
    pub fn by_hash(&self, digest: &[u8; 32]) -> Option<usize> {
        self.check(digest, || 0).map(|c| match c {
            KeyCheck::Valid(k) | KeyCheck::Expired(k) | KeyCheck::Revoked(k) => k,
        })
    }

    /// The key whose secret hashes to `digest`, and whether it may be used now (`now_s`, the
    /// Unix second, read only for a key or secret that has an end): revoked before expired,
    /// and a secret's own end counts as the key's.
    pub fn check(&self, digest: &[u8; 32], now_s: impl FnOnce() -> u64) -> Option<KeyCheck> {
        let at = self.by_hash.get(&self.list, &self.older, digest)? as usize;
        let (k, until_s) = match at.checked_sub(self.list.len()) {
            Some(o) => (self.older[o].key as usize, self.older[o].until_s),
            None => (at, self.list[at].hash_until_s),
        };
        let key = &self.list[k];
        Some(if key.revoked {
            KeyCheck::Revoked(k)
        } else if (key.expires_s != NEVER || until_s != NEVER) && {
            let now = now_s();
            now >= key.expires_s || now >= until_s
        } {
            KeyCheck::Expired(k)
        } else {
            KeyCheck::Valid(k)
        })
    }

    /// The key with this public id.
    pub fn by_id(&self, id: &str) -> Option<usize> {
        self.by_id
            .binary_search_by(|&i| (*self.list[i as usize].id).cmp(id))
            .ok()
            .map(|p| self.by_id[p] as usize)
    }
}

impl Keys {
    /// The keys made through the admin API, in the form the compiler takes them, given back
    /// from their compiled form (`limit_name` names a limit by its index): the one copy a
    /// gateway holds is the compiled one, and a change or a rules reload compiles from this.
    pub fn managed_keys<'a>(&'a self, limit_name: impl Fn(usize) -> &'a str) -> Vec<ManagedKey> {
        // A key's older secrets were pushed right after it, so they follow it in `older`.
        let mut older = self.older.iter().peekable();
        let mut out = Vec::new();
        for (k, key) in self.list.iter().enumerate() {
            let mut secrets = Vec::new();
            while let Some(o) = older.next_if(|o| o.key as usize == k) {
                secrets.push((o.hash, life(o.until_s)));
            }
            if !key.managed {
                continue;
            }
            secrets.push((key.hash, life(key.hash_until_s)));
            let limits = self
                .run(k)
                .iter()
                .map(|&(l, n)| {
                    let (rate, burst) = &self.written[n as usize];
                    (limit_name(l as usize).to_string(), rate.to_string(), *burst)
                })
                .collect();
            out.push(ManagedKey {
                id: key.id.to_string(),
                tenant: key.tenant.to_string(),
                name: key.name.as_deref().map(str::to_string),
                limits,
                secrets,
                expires_at: life(key.expires_s),
                revoked: key.revoked,
            });
        }
        out
    }
}

/// An end as the compiler takes it: `None` for [`NEVER`].
fn life(s: u64) -> Option<u64> {
    (s != NEVER).then_some(s)
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
    /// Every key's hash at its position, then every older secret's at `list.len()` plus its own.
    fn build(list: &[ApiKey], older: &[Older]) -> HashIndex {
        let n = list.len() + older.len();
        let mut slots = vec![EMPTY; (n * 2).next_power_of_two()].into_boxed_slice();
        let mask = slots.len() - 1;
        let hashes = list.iter().map(|k| &k.hash).chain(older.iter().map(|o| &o.hash));
        for (i, h) in hashes.enumerate() {
            let mut s = slot(h) & mask;
            while slots[s] != EMPTY {
                s = (s + 1) & mask;
            }
            slots[s] = i as u32;
        }
        HashIndex { slots }
    }

    fn get(&self, list: &[ApiKey], older: &[Older], digest: &[u8; 32]) -> Option<u32> {
        let mask = self.slots.len().checked_sub(1)?;
        let mut s = slot(digest) & mask;
        // The table is never full, so the probe ends at an empty slot.
        loop {
            let i = self.slots[s];
            if i == EMPTY {
                return None;
            }
            let hash = match list.get(i as usize) {
                Some(k) => &k.hash,
                None => &older[i as usize - list.len()].hash,
            };
            if hash == digest {
                return Some(i);
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
        self.keys.written.push((rate.into(), burst));
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

    /// Sets the life of the key just pushed: when it expires, when its newest secret ends,
    /// whether it is revoked; it was made through the admin API.
    pub(crate) fn set_life(&mut self, expires_s: u64, hash_until_s: u64, revoked: bool) {
        if let Some(k) = self.keys.list.last_mut() {
            k.expires_s = expires_s;
            k.hash_until_s = hash_until_s;
            k.revoked = revoked;
            k.managed = true;
        }
    }

    /// Adds an older secret of the key just pushed, working until `until_s`. The caller has
    /// checked that its hash is new.
    pub(crate) fn push_older(&mut self, hash: [u8; 32], until_s: u64) {
        let key = self.len().saturating_sub(1) as u32;
        self.hashes.insert(hash, key);
        self.keys.older.push(Older { hash, key, until_s });
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
        keys.written.shrink_to_fit();
        keys.older.shrink_to_fit();
        keys.by_hash = HashIndex::build(&keys.list, &keys.older);
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
        expires_s: NEVER,
        hash_until_s: NEVER,
        revoked: false,
        managed: false,
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

    #[test]
    fn a_managed_keys_state_and_its_older_secret_are_checked_at_the_time_asked() {
        let mut b = KeysBuilder::default();
        let (new, old) = (crate::hash_secret(b"new"), crate::hash_secret(b"old"));
        b.push(key("k-1", new), &[]);
        b.set_life(2_000, NEVER, false);
        b.push_older(old, 1_500);
        b.push(key("k-2", crate::hash_secret(b"gone")), &[]);
        b.set_life(NEVER, NEVER, true);
        let keys = b.finish();
        assert_eq!(keys.check(&new, || 1_000), Some(KeyCheck::Valid(0)));
        assert_eq!(keys.check(&old, || 1_499), Some(KeyCheck::Valid(0)));
        assert_eq!(
            keys.check(&old, || 1_500),
            Some(KeyCheck::Expired(0)),
            "the grace ended"
        );
        assert_eq!(
            keys.check(&new, || 2_000),
            Some(KeyCheck::Expired(0)),
            "the key expired"
        );
        let gone = crate::hash_secret(b"gone");
        assert_eq!(keys.check(&gone, || 0), Some(KeyCheck::Revoked(1)));
        assert_eq!(keys.by_hash(&old), Some(0));
        assert_eq!(keys.check(&crate::hash_secret(b"nothing"), || 0), None);
        assert!(keys[0].managed && keys[1].managed);
    }
}
