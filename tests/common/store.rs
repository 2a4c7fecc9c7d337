//! Checks against a real store for the tests that hold `RedisStore` to what it decides and
//! writes: one bucket's check item, and a `RedisStore` on a `RedisServer`.

use tollgate_limit::bucket::{BucketParams, Charge, Rate};
use tollgate_store::redis::{RedisStore, Target};
use tollgate_store::{CheckItem, FailurePolicy};

use super::RedisServer;

/// A check of `cost` on bucket `key` of the given rate and burst, decided locally if the store fails.
pub fn item(key: &str, rate: &str, burst: u64, cost: u64) -> CheckItem {
    let params = BucketParams::new(Rate::parse(rate).unwrap(), burst).unwrap();
    CheckItem::new(
        key.into(),
        Charge {
            params,
            cost,
            shadow: false,
        },
        0,
        FailurePolicy::Local,
    )
}

pub async fn connect(redis: &RedisServer) -> RedisStore {
    RedisStore::connect(Target::node(&redis.url()), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Polls every future once, so each check is queued in the order given, without waiting.
pub async fn queue_all(futures: &mut [std::pin::Pin<Box<tollgate_store::CheckFuture<'_>>>]) {
    use std::future::Future;
    std::future::poll_fn(|cx| {
        for f in futures.iter_mut() {
            assert!(
                f.as_mut().poll(cx).is_pending(),
                "a check finished on its first poll, before it could queue"
            );
        }
        std::task::Poll::Ready(())
    })
    .await;
}

/// A bucket as the Redis scripts keep it, for the models the equivalence tests hold them to:
/// its state and its field's expiry in the call's clock (`lua/bucket.lua`). A field past its
/// expiry reads as missing, a full bucket, whatever rule reads it.
#[derive(Clone, Copy, Debug)]
pub struct Stored {
    pub state: tollgate_limit::bucket::BucketState,
    pub expires_us: u64,
}

impl Stored {
    /// `state` written at `now` under `p`: expiring `b/r` plus a second after its ts, which is
    /// later than now for a bucket in debt.
    pub fn written(
        p: &tollgate_limit::bucket::BucketParams,
        state: tollgate_limit::bucket::BucketState,
        now: u64,
    ) -> Stored {
        let mut px = p.ttl_ms();
        if state.ts > now {
            px += (state.ts - now).div_ceil(1_000);
        }
        Stored {
            state,
            expires_us: now + px * 1_000,
        }
    }

    /// What a script reads at `now`.
    pub fn read(stored: Option<&Stored>, now: u64) -> Option<tollgate_limit::bucket::BucketState> {
        stored.filter(|s| s.expires_us >= now).map(|s| s.state)
    }
}
