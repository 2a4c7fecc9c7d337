//! The page a bucket lives in on Redis: one hash per cluster hash slot, named so it lies in it.
//!
//! Redis spends about 160 bytes on any key with an expiry, more than a bucket's state, so
//! buckets are fields of shared hashes instead of keys of their own (`lua/bucket.lua` reads and
//! writes them). A script may only touch keys of its call's slot, so a bucket's page must hash
//! to the bucket's slot: the page of slot S is `rl:page:{N}` with N the smallest number whose
//! decimal digits hash to S. Every gateway computes the same table, so they all agree on the
//! page of every bucket, on a cluster and on a single node alike.

use std::sync::OnceLock;

use fred::util::redis_keyslot;

/// Hash slots in Redis Cluster.
const SLOTS: usize = 16_384;

/// N of each slot's page name.
fn numbers() -> &'static [u32] {
    static TABLE: OnceLock<Vec<u32>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = vec![u32::MAX; SLOTS];
        let mut left = SLOTS;
        let mut n = 0u32;
        let mut buf = [0u8; 10];
        while left > 0 {
            let slot = &mut table[usize::from(redis_keyslot(decimal(n, &mut buf)))];
            if *slot == u32::MAX {
                *slot = n;
                left -= 1;
            }
            n += 1;
        }
        table
    })
}

/// `n`'s decimal digits, written at the end of `buf`.
fn decimal(mut n: u32, buf: &mut [u8; 10]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// Builds the table of page names now (a few hundred thousand hashes), so that no check waits
/// for it: the store calls this when it starts.
pub fn prepare() {
    numbers();
}

/// The page of the bucket named `key`: `rl:page:{N}`, in the same hash slot.
pub fn page_of(key: &str) -> String {
    let slot = usize::from(redis_keyslot(key.as_bytes()));
    format!("rl:page:{{{}}}", numbers()[slot])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_page_lies_in_its_buckets_slot() {
        for key in [
            "rl:{k7}:plan",
            "rl:{ip:2001:db8:1:2::/64}:unauth",
            "rl:{fp:none}:clients",
            "no-tag",
            "rl:{}:x",
        ] {
            let page = page_of(key);
            assert!(page.starts_with("rl:page:{") && page.ends_with('}'), "{page}");
            assert_eq!(
                redis_keyslot(page.as_bytes()),
                redis_keyslot(key.as_bytes()),
                "{key} -> {page}"
            );
        }
        let names: std::collections::HashSet<u32> = numbers().iter().copied().collect();
        assert!(!names.contains(&u32::MAX), "every slot has a page");
        let mut buf = [0; 10];
        assert_eq!(decimal(0, &mut buf), b"0");
        assert_eq!(decimal(4_294_967_295, &mut buf), b"4294967295");
        assert_eq!(
            names.len(),
            SLOTS,
            "one page per slot, no two slots sharing a name"
        );
    }

    #[test]
    fn buckets_of_one_tag_share_a_page_and_others_mostly_do_not() {
        assert_eq!(page_of("rl:{k7}:plan"), page_of("rl:{k7}:exports"));
        let pages: std::collections::HashSet<String> =
            (0..1000).map(|i| page_of(&format!("rl:{{k{i}}}:plan"))).collect();
        assert!(pages.len() > 900, "{} pages for 1000 tags", pages.len());
    }
}
