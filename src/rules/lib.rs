//! Rules: the JSON file parsed (`raw`), validated and compiled into one immutable [`Snapshot`]
//! of plain data (no socket, pool or task), the buckets one request pays (`plan`), and who is
//! asking (`identity`: API keys and client IPs).
//!
//! A request loads the snapshot once and uses it to the end. Every error names the file, the
//! field and the reason; nothing is defaulted silently.

mod compile;
pub mod headers;
pub mod identity;
pub mod jwt;
pub mod keys;
mod load;
mod model;
pub mod plan;
pub mod quota;
pub mod raw;
mod routes;
pub mod summary;
pub mod tls;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

pub use compile::hash_secret;
use headers::policy_value;
use keys::KeysBuilder;
pub use keys::{ApiKey, KeyCheck, Keys, ManagedKey};
pub use load::*;
pub use model::*;
pub use raw::{Identity, KeyRequirement, LimitClass, Mode, Scope};
use raw::{RawDimension, RawDimensionName, RawEncodedSlashes, RawKey, RawNumbers, RawQuota, RawRules};
pub use tls::UpstreamTls;
pub use tollgate_hello::{BadFingerprint, Fingerprint};
pub use tollgate_limit::adaptive::Bounds as ConcurrencyBounds;
pub use tollgate_limit::batch::LeaseBlock;

/// A rules file that can't be used, with where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {field}: {reason}")]
pub struct RulesError {
    pub file: String,
    pub field: String,
    pub reason: String,
}

/// The default time an upstream has to send its response headers.
pub(crate) const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);
/// How long opening a connection to an upstream may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a kept upstream connection may idle: below the 5 s keep-alive timeout of Node.js
/// and Apache, so the gateway closes first. An upstream that closes sooner (gunicorn: 2 s)
/// wants its own `idle_timeout_ms`; the check before reuse catches most of its closes anyway.
pub(crate) const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// The default wait for a place under an upstream's `max_in_flight`.
pub(crate) const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_millis(50);
/// An adaptive limit's floor and ceiling when the rules leave them out (Envoy's defaults are
/// 3 and 1000; a probe at 4 measures a median of 8 requests in two rounds).
pub(crate) const DEFAULT_CONCURRENCY_MIN: u32 = 4;
pub(crate) const DEFAULT_CONCURRENCY_MAX: u32 = 2000;
/// The largest ceiling an adaptive limit may have: far above what one gateway keeps in flight
/// to one upstream, so a larger number is a typo.
pub(crate) const MAX_CONCURRENCY: u32 = 1_000_000;
/// A route's largest request body when its rules don't say: an upstream behind a gateway should
/// not have to guard its own memory against one client's body.
pub(crate) const DEFAULT_MAX_BODY_BYTES: u64 = 1 << 20;
/// How long an upgraded connection may stay silent both ways when its route doesn't say:
/// longer than the ping interval of common WebSocket stacks (30–60 s), short enough that a
/// peer gone without a word frees its seat within minutes.
pub(crate) const DEFAULT_IDLE_TIMEOUT_MS: u64 = 300_000;
