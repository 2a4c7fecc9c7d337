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
    RedisStore::connect(Target::Node(&redis.url()), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}
