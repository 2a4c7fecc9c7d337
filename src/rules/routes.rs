//! The route matcher compiled once per snapshot: a request's route found in one hash lookup per
//! `/` boundary of its path, however many routes the rules hold.
//!
//! A prefix can only match a path at a length where the path ends, or has a `/` just after or
//! just before it (`Route::matches_path`). So the matcher keys every route by its prefix folded
//! to lower case and, for a request, looks up the path's head at each such length, longest
//! first. A bucket holds the routes whose folded prefixes hash alike, in snapshot order; each
//! candidate is still checked with `matches_path` and `matches_method`, so case, collisions and
//! methods are judged exactly as the scan judged them, and the first route that passes is the
//! one the scan (longest prefix first, then snapshot order) would have taken.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use http::Method;

use crate::Route;

/// Lookups per request are at most this many without a heap allocation; a path with more
/// candidate lengths (many short segments under long prefixes) spills into a `Vec`.
const INLINE_CANDIDATES: usize = 32;

#[derive(Debug)]
pub(crate) struct Matcher {
    /// Route indices, ascending, by the hash of their prefix folded to ASCII lower case.
    buckets: HashMap<u64, Box<[usize]>, BuildHasherDefault<Premixed>>,
    /// Which prefix lengths some route has, up to the longest: a path boundary at any other
    /// length costs no lookup.
    lengths: Box<[bool]>,
}

impl Matcher {
    /// Indexes `routes`, which must already be in match order (longest prefix first).
    pub(crate) fn new(routes: &[Route]) -> Matcher {
        let longest = routes.iter().map(|r| r.prefix.len()).max();
        let mut lengths = vec![false; longest.map_or(0, |l| l + 1)];
        let mut buckets: HashMap<u64, Vec<usize>, BuildHasherDefault<Premixed>> = HashMap::default();
        for (i, r) in routes.iter().enumerate() {
            lengths[r.prefix.len()] = true;
            buckets.entry(fold_hash(r.prefix.as_bytes())).or_default().push(i);
        }
        Matcher {
            buckets: buckets
                .into_iter()
                .map(|(h, v)| (h, v.into_boxed_slice()))
                .collect(),
            lengths: lengths.into_boxed_slice(),
        }
    }

    /// The first route of `routes` (the slice `new` indexed) that takes this method and path:
    /// the same answer as scanning them in order.
    pub(crate) fn find(&self, routes: &[Route], method: &Method, path: &str) -> Option<usize> {
        let bytes = path.as_bytes();
        let mut inline = [(0usize, 0u64); INLINE_CANDIDATES];
        let mut count = 0;
        let mut spill: Vec<(usize, u64)> = Vec::new();
        let mut h = FNV_OFFSET;
        // The running hash of the head reaches each candidate length in one pass; the
        // lookups then go longest first.
        for len in 0..self.lengths.len().min(bytes.len() + 1) {
            if len > 0 {
                h = fnv_step(h, bytes[len - 1]);
            }
            let boundary = len == bytes.len() || bytes[len] == b'/' || (len > 0 && bytes[len - 1] == b'/');
            if boundary && self.lengths[len] {
                if count < INLINE_CANDIDATES {
                    inline[count] = (len, h);
                    count += 1;
                } else {
                    spill.push((len, h));
                }
            }
        }
        spill
            .iter()
            .rev()
            .chain(inline[..count].iter().rev())
            .find_map(|&(len, h)| {
                self.buckets.get(&h)?.iter().copied().find(|&i| {
                    let r = &routes[i];
                    r.prefix.len() == len && r.matches_method(method) && r.matches_path(path)
                })
            })
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv_step(h: u64, b: u8) -> u64 {
    (h ^ u64::from(b.to_ascii_lowercase())).wrapping_mul(FNV_PRIME)
}

/// FNV-1a of the bytes folded to ASCII lower case: a case-insensitive route and any spelling of
/// its prefix land in one bucket, and a case-sensitive one's other spellings are turned away
/// by `matches_path`.
fn fold_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET, |h, &b| fnv_step(h, b))
}

/// The map's hasher for keys that are already FNV hashes: one mixing step (MurmurHash3's
/// finalizer) spreads FNV's weak high bits, which the table's probe tags come from. The keys
/// come from the rules file; a request only looks up, so a crafted path can collide with a
/// bucket at worst, and costs one more `matches_path`.
#[derive(Debug, Default, Clone, Copy)]
struct Premixed(u64);

impl Hasher for Premixed {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn finish(&self) -> u64 {
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^ (x >> 33)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use http::Method;
    use proptest::prelude::*;
    use serde_json::json;

    use crate::{CompileOptions, Snapshot, compile};

    /// A route as the test writes it: case-insensitive upstream or not, method, path.
    type RouteRow = (bool, &'static str, String);

    fn snapshot(routes: &[RouteRow]) -> Snapshot {
        let routes: Vec<_> = routes
            .iter()
            .map(|(ci, method, path)| {
                json!({
                    "method": method,
                    "path": path,
                    "upstream": if *ci { "folded" } else { "exact" },
                    "key": "optional",
                })
            })
            .collect();
        let rules = json!({
            "version": 1,
            "upstreams": {
                "exact": {"url": "http://127.0.0.1:9"},
                "folded": {"url": "http://127.0.0.1:9", "paths": "case-insensitive"},
            },
            "routes": routes,
        });
        compile(
            rules.to_string().as_bytes(),
            "routes.json",
            CompileOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{e}\n{rules:#}"))
    }

    fn name_of<'a>(snap: &'a Snapshot, method: Method, path: &str) -> Option<&'a str> {
        let got = snap.route(&method, path);
        assert_eq!(got, snap.route_by_scan(&method, path), "{method} {path}");
        got.map(|i| &*snap.routes[i].name)
    }

    const SEGMENTS: &[&str] = &["a", "A", "b", "ab", "aB", "%2F"];

    /// Canonical paths over a few segments that are prefixes of one another and differ only
    /// in case, so routes share, nest and tie.
    fn path(max_depth: usize) -> impl Strategy<Value = String> {
        (
            prop::collection::vec(prop::sample::select(SEGMENTS), 0..=max_depth),
            any::<bool>(),
        )
            .prop_map(|(segs, dir)| {
                let mut p: String = segs.iter().map(|s| format!("/{s}")).collect();
                if dir || p.is_empty() {
                    p.push('/');
                }
                p
            })
    }

    fn routes() -> impl Strategy<Value = Vec<RouteRow>> {
        prop::collection::vec(
            (
                any::<bool>(),
                prop::sample::select(&["GET", "POST", "TRACE", "*"][..]),
                path(3),
            ),
            0..40,
        )
        .prop_map(|mut v| {
            // The compiler refuses two routes with the same method and path.
            let mut seen = BTreeSet::new();
            v.retain(|(_, m, p)| seen.insert((*m, p.clone())));
            v
        })
    }

    /// Request paths: canonical ones over the routes' segments, and any string of `/`, letters
    /// and `%`, canonical or not, with or without a leading `/`.
    fn request_path() -> impl Strategy<Value = String> {
        prop_oneof![path(5), "[/aAbx%2F]{0,12}"]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn the_matcher_takes_the_route_the_scan_takes(
            rows in routes(),
            paths in prop::collection::vec(request_path(), 1..24),
        ) {
            let snap = snapshot(&rows);
            for p in &paths {
                for m in [Method::GET, Method::POST, Method::TRACE, Method::PUT] {
                    prop_assert_eq!(snap.route(&m, p), snap.route_by_scan(&m, p), "{} {}", m, p);
                }
            }
        }
    }

    #[test]
    fn longest_prefix_then_method_then_file_order() {
        let snap = snapshot(&[
            (false, "*", "/v1/".into()),
            (false, "GET", "/v1".into()),
            (true, "*", "/V1/orders".into()),
            (false, "GET", "/v1/orders".into()),
            (false, "*", "/v1/orders".into()),
            (false, "TRACE", "/".into()),
        ]);
        // Same length: the route naming the method first, then the file's order.
        assert_eq!(
            name_of(&snap, Method::GET, "/v1/orders/7"),
            Some("GET /v1/orders")
        );
        assert_eq!(name_of(&snap, Method::POST, "/v1/orders"), Some("* /V1/orders"));
        assert_eq!(name_of(&snap, Method::POST, "/V1/ORDERS/7"), Some("* /V1/orders"));
        // `/v1/` takes only what is under it; `/v1` takes itself and what is under it.
        assert_eq!(name_of(&snap, Method::POST, "/v1"), None);
        assert_eq!(name_of(&snap, Method::GET, "/v1"), Some("GET /v1"));
        assert_eq!(name_of(&snap, Method::POST, "/v1/x"), Some("* /v1/"));
        assert_eq!(name_of(&snap, Method::GET, "/v1x"), None);
        // A catch-all never takes TRACE; a route naming it does.
        assert_eq!(name_of(&snap, Method::TRACE, "/v1/orders"), Some("TRACE /"));
        assert_eq!(name_of(&snap, Method::GET, "orders"), None);
    }

    #[test]
    fn paths_with_more_boundaries_than_fit_inline() {
        let rows: Vec<RouteRow> = (1..=40)
            .flat_map(|d| {
                let p = "/a".repeat(d);
                [(false, "GET", p.clone()), (false, "POST", format!("{p}/"))]
            })
            .collect();
        let snap = snapshot(&rows);
        for depth in [1, 31, 33, 40, 60] {
            let p = "/a".repeat(depth);
            let deepest = "/a".repeat(depth.min(40));
            let want = format!("GET {deepest}");
            assert_eq!(
                name_of(&snap, Method::GET, &p),
                Some(want.as_str()),
                "depth {depth}"
            );
            let under = format!("{p}/b");
            let want = format!("POST {deepest}/");
            assert_eq!(
                name_of(&snap, Method::POST, &under),
                Some(want.as_str()),
                "depth {depth}"
            );
        }
    }

    #[test]
    fn a_second_route_of_the_same_name_is_refused() {
        let rules = json!({
            "version": 1,
            "upstreams": {"exact": {"url": "http://127.0.0.1:9"}},
            "routes": [
                {"name": "orders", "method": "GET", "path": "/v1/orders", "upstream": "exact"},
                {"name": "other", "method": "GET", "path": "/v1/other", "upstream": "exact"},
                {"name": "orders", "method": "POST", "path": "/v1/orders", "upstream": "exact"},
            ],
        });
        let e = compile(
            rules.to_string().as_bytes(),
            "routes.json",
            CompileOptions::default(),
        )
        .map(|_| ())
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "routes.json: routes[2].name: duplicate route name \"orders\""
        );
    }

    fn routes_compiled(routes: serde_json::Value) -> Result<Snapshot, String> {
        let rules = json!({
            "version": 1,
            "upstreams": {"exact": {"url": "http://127.0.0.1:9"}},
            "routes": routes,
        });
        compile(
            rules.to_string().as_bytes(),
            "routes.json",
            CompileOptions::default(),
        )
        .map_err(|e| e.to_string())
    }

    #[test]
    fn method_override_is_off_unless_a_route_opts_in() {
        let snap = routes_compiled(json!([
            {"method": "POST", "path": "/v1/items", "upstream": "exact"},
            {"method": "DELETE", "path": "/v1/items", "upstream": "exact"},
        ]))
        .unwrap();
        assert!(!snap.method_override);
        assert!(snap.routes.iter().all(|r| !r.method_override));
        let snap = routes_compiled(json!([
            {"method": "POST", "path": "/v1/items", "upstream": "exact"},
            {"method": "DELETE", "path": "/v1/items", "upstream": "exact", "method_override": true},
            {"method": "*", "path": "/v2/", "upstream": "exact", "method_override": true},
        ]))
        .unwrap();
        assert!(snap.method_override);
        let opted: Vec<&str> = snap
            .routes
            .iter()
            .filter(|r| r.method_override)
            .map(|r| &*r.name)
            .collect();
        assert_eq!(opted, ["DELETE /v1/items", "* /v2/"]);
    }

    #[test]
    fn method_override_is_a_boolean_on_a_method_a_post_may_become() {
        let e = routes_compiled(json!([
            {"method": "DELETE", "path": "/v1/items", "upstream": "exact", "method_override": "yes"},
        ]))
        .unwrap_err();
        assert!(e.contains("method_override"), "{e}");
        for method in ["HEAD", "TRACE"] {
            let e = routes_compiled(json!([
                {"method": method, "path": "/v1/items", "upstream": "exact", "method_override": true},
            ]))
            .unwrap_err();
            assert!(
                e.starts_with("routes.json: routes[0].method_override: a POST can't be overridden into"),
                "{e}"
            );
        }
        for method in ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "*"] {
            routes_compiled(json!([
                {"method": method, "path": "/v1/items", "upstream": "exact", "method_override": true},
            ]))
            .unwrap_or_else(|e| panic!("{method}: {e}"));
        }
    }
}
