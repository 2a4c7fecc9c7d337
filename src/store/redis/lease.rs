//! LEASE and GIVE BACK, one `lua/lease.lua` call each: the store's side of the gateway's
//! leased blocks, and the records of what each gateway holds.

use fred::prelude::{Key, Value};

use super::{RedisStore, as_i64, int, store_error};
use crate::lease::{GiveBackReply, LeaseReply, Lessor, held_key};
use crate::page::page_of;
use crate::{BoxFuture, StoreError};
use tollgate_limit::bucket::BucketParams;
use tollgate_limit::lease::{Account, Grant, RECORD_TTL_US, Recorded};

/// ARGV of one `lua/lease.lua` call: the clock, the operation, the bucket's numbers, the units,
/// for a lease one block cycle, and the caller's account for its record.
fn lease_args(
    clock: i64,
    op: &'static str,
    p: &BucketParams,
    units: u64,
    cycle_us: u64,
    acct: &Account<'_>,
) -> Vec<Value> {
    vec![
        Value::Integer(clock),
        Value::from(op),
        Value::Integer(as_i64(p.scale)),
        Value::Integer(as_i64(p.refill)),
        Value::Integer(as_i64(p.capacity)),
        // Never more than the capacity: a block is at most the burst, and a give-back of more
        // than the capacity fills the bucket all the same.
        Value::Integer(as_i64(units.min(p.capacity))),
        Value::Integer(as_i64(p.ttl_ms())),
        Value::Integer(as_i64(cycle_us)),
        Value::from(acct.holder),
        Value::Integer(as_i64(acct.spent)),
        Value::Integer(as_i64(RECORD_TTL_US)),
    ]
}

/// The two keys of a `lua/lease.lua` call: the bucket and its records.
fn lease_keys(key: &str) -> Vec<Key> {
    vec![Key::from(key), Key::from(page_of(key)), Key::from(held_key(key))]
}

/// Reads `{granted, now, tokens, until, reclaimed, held}`.
fn parse_lease_reply(reply: Value) -> Result<([u64; 4], Recorded), StoreError> {
    let bad = |what: String| StoreError::Protocol(format!("lua/lease.lua answered {what}"));
    let Value::Array(items) = reply else {
        return Err(bad(format!("{reply:?}, not an array")));
    };
    if items.len() != 6 {
        return Err(bad(format!("{} values, not 6", items.len())));
    }
    let mut n = [0u64; 6];
    for (i, v) in items.iter().enumerate() {
        n[i] = int(v)
            .and_then(|x| u64::try_from(x).ok())
            .ok_or_else(|| bad(format!("{v:?} at {}, not a non-negative integer", i + 1)))?;
    }
    if n[0] > 1 {
        return Err(bad(format!("granted = {}", n[0])));
    }
    let recorded = Recorded {
        reclaimed: n[4],
        held: n[5],
    };
    Ok(([n[0], n[1], n[2], n[3]], recorded))
}

impl RedisStore {
    /// LEASE: a whole block of `block` tokens from the bucket `key`, or nothing and the store
    /// time before which to ask again (`now + cycle_us`); expired records reclaimed first, and
    /// the grant and `acct`'s spending noted in the caller's record.
    pub async fn lease(
        &self,
        key: &str,
        p: &BucketParams,
        block: u64,
        cycle_us: u64,
        acct: Account<'_>,
    ) -> Result<LeaseReply, StoreError> {
        let reply = self
            .shared
            .eval_script(&self.shared.lease_sha, || {
                (
                    lease_keys(key),
                    lease_args(
                        self.shared.clock_arg(),
                        "lease",
                        p,
                        p.units(block),
                        cycle_us,
                        &acct,
                    ),
                )
            })
            .await
            .map_err(|e| store_error(&e))?;
        let ([granted, now_us, units_left, until_us], recorded) = parse_lease_reply(reply)?;
        let grant = if granted == 1 {
            Grant::Granted { tokens: block }
        } else {
            if until_us < now_us {
                return Err(StoreError::Protocol(format!(
                    "lua/lease.lua refused with until {until_us} before now {now_us}"
                )));
            }
            Grant::Denied { until_us }
        };
        Ok(LeaseReply {
            grant,
            now_us,
            units_left,
            recorded,
        })
    }

    /// GIVE BACK: `tokens` unused tokens added to the bucket `key`, capped at its burst;
    /// expired records reclaimed first, and the tokens and `acct`'s spending taken off the
    /// caller's record.
    pub async fn give_back(
        &self,
        key: &str,
        p: &BucketParams,
        tokens: u64,
        acct: Account<'_>,
    ) -> Result<GiveBackReply, StoreError> {
        let reply = self
            .shared
            .eval_script(&self.shared.lease_sha, || {
                (
                    lease_keys(key),
                    lease_args(self.shared.clock_arg(), "give", p, p.units(tokens), 0, &acct),
                )
            })
            .await
            .map_err(|e| store_error(&e))?;
        let ([_, now_us, units_left, _], recorded) = parse_lease_reply(reply)?;
        Ok(GiveBackReply {
            now_us,
            units_left,
            recorded,
        })
    }

    /// The lease script's SHA-1.
    pub fn lease_script_sha(&self) -> &str {
        &self.shared.lease_sha
    }
}

impl Lessor for RedisStore {
    fn lease<'a>(
        &'a self,
        key: &'a str,
        p: &'a BucketParams,
        block: u64,
        cycle_us: u64,
        acct: Account<'a>,
    ) -> BoxFuture<'a, Result<LeaseReply, StoreError>> {
        Box::pin(RedisStore::lease(self, key, p, block, cycle_us, acct))
    }

    fn give_back<'a>(
        &'a self,
        key: &'a str,
        p: &'a BucketParams,
        tokens: u64,
        acct: Account<'a>,
    ) -> BoxFuture<'a, Result<GiveBackReply, StoreError>> {
        Box::pin(RedisStore::give_back(self, key, p, tokens, acct))
    }
}
