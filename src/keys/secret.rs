//! The secrets of managed keys: how one is made, the format that lets a mistyped one be
//! refused before any lookup, and the hash by which every key, managed or from the rules
//! file, is found.
//!
//! A generated secret is 41 ASCII characters: `tg_`, a body of 32 base62 characters drawn
//! from the thread's CSPRNG (about 190 bits), and a checksum of 6 base62 characters: the
//! CRC-32 (IEEE, as zlib's) of the first 35 characters (`tg_` and the body), written as a
//! base62 number, most significant digit first, padded with `0`. The base62 digits are
//! `0-9A-Za-z` in that order. For example `tg_` + 32 characters + `2lkCB1`.
//!
//! A CRC-32 catches every change confined to 32 consecutive bits, so any one mistyped or
//! swapped pair of characters fails the check. The prefix also lets secret scanners find
//! leaked keys.

use rand::Rng;
use rand::distr::Alphanumeric;
use sha2::{Digest, Sha256};

/// What every generated secret starts with.
pub const PREFIX: &str = "tg_";
const BODY: usize = 32;
const CHECK: usize = 6;
/// The length of a generated secret.
pub const LEN: usize = PREFIX.len() + BODY + CHECK;

const BASE62: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// A new secret and its hash. The secret is shown once, to whoever created or rotated the
/// key; only the hash is kept.
pub fn generate() -> (String, [u8; 32]) {
    let mut secret = String::with_capacity(LEN);
    secret.push_str(PREFIX);
    secret.extend(rand::rng().sample_iter(Alphanumeric).take(BODY).map(char::from));
    let check = checksum(secret.as_bytes());
    secret.extend(check.iter().map(|&b| char::from(b)));
    let hash = hash(&secret);
    (secret, hash)
}

/// What the form of a presented secret says, before any lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No `tg_` prefix: perhaps a key of the rules file, whose secrets can be anything.
    NotOurs,
    /// Our format, checksum right: worth looking up.
    Good,
    /// `tg_` but not a secret we could have made (a typo, a truncated paste): refuse it
    /// without a lookup.
    BadChecksum,
}

/// Judges a presented secret by its form alone. A rules-file secret that happens to start
/// with `tg_` is judged as ours, so such secrets should not be written into rules files.
pub fn looks_generated(presented: impl AsRef<[u8]>) -> Verdict {
    let s = presented.as_ref();
    if !s.starts_with(PREFIX.as_bytes()) {
        return Verdict::NotOurs;
    }
    if s.len() != LEN || !s[PREFIX.len()..].iter().all(u8::is_ascii_alphanumeric) {
        return Verdict::BadChecksum;
    }
    let (head, check) = s.split_at(LEN - CHECK);
    if checksum(head) == check {
        Verdict::Good
    } else {
        Verdict::BadChecksum
    }
}

/// The SHA-256 of a secret's bytes as presented; `tollgate_rules::hash_secret` is the same
/// function, so a key is found by one hash whichever source it came from.
pub fn hash(secret: impl AsRef<[u8]>) -> [u8; 32] {
    Sha256::digest(secret.as_ref()).into()
}

/// `text`'s CRC-32 as 6 base62 digits: 62^6 is above 2^32, so every value fits.
fn checksum(text: &[u8]) -> [u8; CHECK] {
    let mut n = u64::from(crc32(text));
    let mut out = [b'0'; CHECK];
    for d in out.iter_mut().rev() {
        *d = BASE62[(n % 62) as usize];
        n /= 62;
    }
    out
}

/// CRC-32/ISO-HDLC, bit by bit: it runs over 35 bytes, once a request at most.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// Random base62 characters, for generated key ids.
pub(crate) fn base62(n: usize) -> String {
    rand::rng()
        .sample_iter(Alphanumeric)
        .take(n)
        .map(char::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_is_the_usual_one() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn a_generated_secret_has_the_documented_form() {
        let (s, h) = generate();
        assert_eq!(s.len(), LEN);
        assert!(s.starts_with("tg_"));
        assert!(s[3..].bytes().all(|b| b.is_ascii_alphanumeric()), "{s}");
        assert_eq!(looks_generated(&s), Verdict::Good);
        assert_eq!(h, hash(s.as_bytes()));
        let (t, g) = generate();
        assert_ne!(s, t);
        assert_ne!(h, g);
    }

    #[test]
    fn the_checksum_is_written_as_documented() {
        let head = "tg_0123456789abcdefghijklmnopqrstuv";
        let n = crc32(head.as_bytes());
        let check: String = checksum(head.as_bytes()).iter().map(|&b| char::from(b)).collect();
        let value = check.bytes().fold(0u64, |acc, b| {
            acc * 62 + BASE62.iter().position(|&d| d == b).unwrap() as u64
        });
        assert_eq!(value, u64::from(n));
        assert_eq!(looks_generated(format!("{head}{check}")), Verdict::Good);
    }

    #[test]
    fn every_one_character_typo_and_swap_is_refused() {
        let (s, _) = generate();
        let bytes = s.as_bytes();
        for i in PREFIX.len()..LEN {
            for &c in BASE62 {
                if c == bytes[i] {
                    continue;
                }
                let mut typo = bytes.to_vec();
                typo[i] = c;
                assert_eq!(
                    looks_generated(&typo),
                    Verdict::BadChecksum,
                    "{s} with {} at {i}",
                    char::from(c)
                );
            }
            if i + 1 < LEN && bytes[i] != bytes[i + 1] {
                let mut swapped = bytes.to_vec();
                swapped.swap(i, i + 1);
                assert_eq!(
                    looks_generated(&swapped),
                    Verdict::BadChecksum,
                    "{s} swapped at {i}"
                );
            }
        }
    }

    #[test]
    fn other_strings_are_not_ours_or_refused() {
        assert_eq!(looks_generated("demo-secret-1"), Verdict::NotOurs);
        assert_eq!(looks_generated(""), Verdict::NotOurs);
        assert_eq!(looks_generated("TG_abc"), Verdict::NotOurs);
        let (s, _) = generate();
        assert_eq!(looks_generated(&s[..LEN - 1]), Verdict::BadChecksum);
        assert_eq!(looks_generated(format!("{s}x")), Verdict::BadChecksum);
        let mut dash = s.clone().into_bytes();
        dash[10] = b'-';
        assert_eq!(looks_generated(&dash), Verdict::BadChecksum);
        assert_eq!(looks_generated(b"tg_\xff"), Verdict::BadChecksum);
        assert_eq!(looks_generated("tg_"), Verdict::BadChecksum);
    }

    #[test]
    fn the_hash_is_sha256_of_the_bytes() {
        // The rules crate's own test vector for tollgate_rules::hash_secret.
        assert_eq!(
            hex::encode(hash("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
