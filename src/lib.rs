//! Tollgate: an HTTP reverse-proxy gateway that enforces per-key, per-route and per-IP
//! token-bucket limits in one all-or-nothing check, alone or as a fleet sharing Redis.
//!
//! Modules in data-path order (their layers, and where a change goes: `src/ARCHITECTURE.md`):
//! - [`config`]: the `serve` flags and environment, validated.
//! - [`app`]: assembles rules, store and listeners into a running gateway.
//! - [`server`]: accepts TCP/TLS connections, HTTP/1.1 and HTTP/2, drains on shutdown; a
//!   handler may serve plain HTTP/1.1 connections itself first.
//! - [`gateway`]: one request's path: route → identity → plan → store check → 429 or forward;
//!   its express lane serves plain HTTP/1.1 requests without a body in the connection's task.
//! - [`http1`]: the `tollgate-http1` crate (`src/http1/`): the one reader of HTTP/1
//!   (canonical request paths, chunked bodies, upstream response heads, `Connection` tokens,
//!   idempotent methods, request heads refused before anything reads them) for the watcher, the express lane and the proxy.
//! - [`rules`]: the `tollgate-rules` crate (`src/rules/`): the rules file parsed, validated and
//!   compiled into an immutable `Snapshot`, and
//!   a request's buckets (`rules::plan`).
//! - [`reload`]: live rules: the file watch and SIGHUP, swapping in only higher versions.
//! - [`identity`] (in `tollgate-rules`): API key (compared by SHA-256) and client IP (trusted proxies only).
//! - [`limit`]: the `tollgate-limit` crate (`src/limit/`): exact token-bucket math, clocks, a
//!   check's items and outcome, decisions, the lease core; no I/O, no HTTP.
//! - [`store`]: the `tollgate-store` crate (`src/store/`): the `Store` trait (check, and refund of an undelivered request), the embedded
//!   `MemoryStore`, the shared `RedisStore`, its guard, and `Leases` (hot keys spent from leased
//!   blocks in memory).
//! - [`respond`]: every response the gateway makes itself, in one place.
//! - [`proxy`]: kept upstream connections, the upstream's header edits (hop-by-hop stripping,
//!   `X-Forwarded-*`), 502/504.
//! - [`metrics`], [`logsample`]: the `tollgate-telemetry` crate (`src/telemetry/`): what the
//!   operator sees: Prometheus metrics, sampled log lines.
//! - [`admin`]: the admin listener (health, readiness, metrics, running rules).
//! - [`demo`]: the built-in demo upstream.
//! - [`replay`]: `tollgate replay`, traces through the same limiter code on a virtual clock.
//! - [`fleet`]: `tollgate fleet`, N gateway processes on one store under the spec's storm.

pub use tollgate_fleet as fleet;
pub use tollgate_gateway::admin;
pub use tollgate_gateway::app;
pub use tollgate_gateway::config;
pub use tollgate_gateway::demo;
pub use tollgate_gateway::proxy;
pub use tollgate_gateway::reload;
pub use tollgate_gateway::request as gateway;
pub use tollgate_gateway::respond;
pub use tollgate_gateway::server;
pub use tollgate_http1 as http1;
pub use tollgate_limit as limit;
pub use tollgate_replay as replay;
pub use tollgate_rules as rules;
pub use tollgate_rules::identity;
pub use tollgate_store as store;
pub use tollgate_telemetry::{logsample, metrics};
