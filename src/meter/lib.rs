//! Metering, kept apart from the limiter: a bucket refills, expires, is bypassed in an outage
//! and overshoots with leases, so it cannot say what a partner used. Each gateway counts every
//! request it admitted per key, whatever decided it, and appends its running totals as
//! records ([`record`]) to the Redis stream `tollgate:usage` or, on the embedded store, to a
//! SQLite file ([`sqlite`]). A record carries a running total, not a delta, so a record read
//! twice changes nothing. Quotas (`tollgate_rules::quota`) are calendar days and months in a time zone;
//! the consumer that adds records up sets `near`/`over` flags ([`flags`]) that gateways read.
//!
//! That consumer is `tollgate meter` ([`cli`], [`consumer`]): it keeps the largest total per
//! identity and key and adds only what a larger total brings, per key, day and month in the
//! key's quota zone ([`ledger`], in Redis by `lua/meter_*.lua` or in the SQLite file), reports
//! identities that fell silent without an `end` record, and answers `usage` and `export`.

pub mod cli;
pub mod consumer;
pub mod counter;
pub mod flags;
pub(crate) mod ledger;
pub(crate) mod ledger_redis;
pub(crate) mod ledger_sqlite;
pub(crate) mod ledger_types;
pub mod metrics;
pub mod record;
pub mod sink;
pub mod sqlite;
