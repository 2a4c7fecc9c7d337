//! Our token-bucket mapping of the IETF `RateLimit-Policy` and `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers-11), serialized as RFC 9651 structured fields.
//!
//! The draft defines quota policies over windows; a token bucket has two numbers, so each
//! limit advertises two policies: its burst, `"<name>-burst";q=b;w=ceil(b/r)` (the bucket
//! refills from empty in that window), and its rate, `"<name>";q=N;w=P`. `RateLimit` names the
//! burst policy of the deciding bucket, with `r` its whole tokens left and `t` the seconds to
//! wait: on a refusal the same wait as `Retry-After`, on an admission the seconds until the
//! bucket is full again (0 when it is full).

use http::HeaderValue;
use sfv::{KeyRef, ListSerializer, StringRef};

use tollgate_limit::bucket::{BucketParams, US_PER_S};

/// Precomputed at rule load: the `RateLimit-Policy` value of one limit with these numbers.
pub fn policy_value(name: &str, p: &BucketParams) -> Result<HeaderValue, String> {
    let burst_name = format!("{name}-burst");
    let q = KeyRef::constant("q");
    let w = KeyRef::constant("w");
    let sfv_int = |v: u64| {
        sfv::Integer::try_from(v).map_err(|_| format!("{v} is too large for a structured field integer"))
    };
    let burst_window = p.fill_time_us().div_ceil(US_PER_S).max(1);
    let rate_window = p.rate.period_us.div_ceil(US_PER_S).max(1);
    let mut ser = ListSerializer::new();
    ser.bare_item(StringRef::from_str(&burst_name).map_err(|e| format!("limit name {name:?}: {e}"))?)
        .parameter(q, sfv_int(p.burst)?)
        .parameter(w, sfv_int(burst_window)?);
    ser.bare_item(StringRef::from_str(name).map_err(|e| format!("limit name {name:?}: {e}"))?)
        .parameter(q, sfv_int(p.rate.tokens)?)
        .parameter(w, sfv_int(rate_window)?);
    let text = ser.finish().unwrap_or_default();
    HeaderValue::from_str(&text).map_err(|e| format!("limit name {name:?}: {e}"))
}

/// A limit on requests in flight: `"<name>";q=N;qu="concurrent-requests"`.
pub fn concurrency_policy_value(name: &str, max: u32) -> Result<HeaderValue, String> {
    let mut ser = ListSerializer::new();
    ser.bare_item(StringRef::from_str(name).map_err(|e| format!("limit name {name:?}: {e}"))?)
        .parameter(KeyRef::constant("q"), sfv::Integer::from(max))
        .parameter(KeyRef::constant("qu"), StringRef::constant("concurrent-requests"));
    let text = ser.finish().unwrap_or_default();
    HeaderValue::from_str(&text).map_err(|e| format!("limit name {name:?}: {e}"))
}

/// The `RateLimit` value for one answer: `"<name>-burst";r=<remaining>;t=<seconds>`.
///
/// Built by hand on the hot path: limit names are validated at load to `[A-Za-z0-9._-]`, which
/// an RFC 9651 string carries as is, and the integers are clamped to the 15 digits it allows.
/// A unit test checks the result against the `sfv` serializer.
pub fn state_value(name: &str, remaining: u64, t_secs: u64) -> HeaderValue {
    let mut out = bytes::BytesMut::with_capacity(name.len() + 40);
    write_state(&mut out, name, remaining, t_secs);
    HeaderValue::from_maybe_shared(out.freeze()).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Appends the bytes of [`state_value`], for a head written without a header map.
pub fn write_state(out: &mut bytes::BytesMut, name: &str, remaining: u64, t_secs: u64) {
    out.extend_from_slice(b"\"");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"-burst\";r=");
    out.extend_from_slice(
        itoa::Buffer::new()
            .format(remaining.min(MAX_SF_INTEGER))
            .as_bytes(),
    );
    out.extend_from_slice(b";t=");
    out.extend_from_slice(itoa::Buffer::new().format(t_secs.min(MAX_SF_INTEGER)).as_bytes());
}

/// The largest integer an RFC 9651 structured field can carry.
const MAX_SF_INTEGER: u64 = 999_999_999_999_999;

#[cfg(test)]
mod tests {
    use super::*;
    use sfv::ItemSerializer;
    use tollgate_limit::bucket::Rate;

    #[test]
    fn k7_policy_matches_600_a_minute_burst_20() {
        let p = BucketParams::new(Rate::parse("600/60s").unwrap(), 20).unwrap();
        assert_eq!(
            policy_value("k7", &p).unwrap(),
            r#""k7-burst";q=20;w=2, "k7";q=600;w=60"#
        );
        assert_eq!(state_value("k7", 0, 1), r#""k7-burst";r=0;t=1"#);
    }

    #[test]
    fn hand_built_state_matches_the_sfv_serializer() {
        for (name, r, t) in [
            ("plan", 0u64, 0u64),
            ("a.b_c-d", 17, 3),
            ("x", u64::MAX, 999_999_999_999_999),
        ] {
            let mut expected = String::new();
            ItemSerializer::with_buffer(&mut expected)
                .bare_item(StringRef::from_str(&format!("{name}-burst")).unwrap())
                .parameter(
                    KeyRef::constant("r"),
                    sfv::Integer::try_from(r.min(MAX_SF_INTEGER)).unwrap(),
                )
                .parameter(
                    KeyRef::constant("t"),
                    sfv::Integer::try_from(t.min(MAX_SF_INTEGER)).unwrap(),
                );
            assert_eq!(state_value(name, r, t), expected.as_str());
        }
    }

    #[test]
    fn a_concurrency_policy_names_its_unit() {
        assert_eq!(
            concurrency_policy_value("inflight", 10).unwrap(),
            r#""inflight";q=10;qu="concurrent-requests""#
        );
    }

    #[test]
    fn windows_round_up() {
        let p = BucketParams::new(Rate::parse("1/5s").unwrap(), 1).unwrap();
        assert_eq!(
            policy_value("exports", &p).unwrap(),
            r#""exports-burst";q=1;w=5, "exports";q=1;w=5"#
        );
        assert_eq!(tollgate_limit::bucket::secs_to_full(&p, 0), 5);
        assert_eq!(tollgate_limit::bucket::secs_to_full(&p, p.capacity), 0);
    }
}
