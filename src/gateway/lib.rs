//! Tollgate's gateway: everything between a client's socket and an upstream's, on top of the
//! rules, the store and the limiter core.
//!
//! Modules in data-path order (the layers, and where a change goes: `src/ARCHITECTURE.md`):
//! - [`config`]: the `serve` flags and environment, validated.
//! - [`store_url`]: `--store`'s URL: which store, and where.
//! - [`app`]: start-up, a phase a file: rules, store, gateway, tasks, listeners.
//! - [`server`]: accepts TCP/TLS connections, HTTP/1.1 and HTTP/2, drains on shutdown; a
//!   handler may serve plain HTTP/1.1 connections itself first; one shard per thread, each
//!   accepting on a listener of its own.
//! - [`shard`]: which serving thread this is, for state kept per shard.
//! - [`request`]: one request's steps: route → identity → plan → store check → 429 or forward
//!   → finish, written once; its express lane serves plain HTTP/1.1 requests without a body in
//!   the connection's task.
//! - [`concurrency`]: an upstream's places for requests in flight: the adaptive limit that
//!   follows its latency, the static `max_in_flight` ceiling, the place a request holds.
//! - [`respond`]: every answer the gateway makes itself, in one place.
//! - [`boxed`]: futures put on the heap without a copy of their whole size on the stack.
//! - [`bufs`]: read and write buffers lent to busy connections, kept per thread between
//!   lendings.
//! - [`proxy`]: the one HTTP/1.1 client to upstreams, its kept connections, the upstream's
//!   header edits (hop-by-hop stripping, `X-Forwarded-*`), 502/504.
//! - [`upgrade`]: upgraded connections (WebSocket): the protocol a route allows, the relay
//!   both ways after the upstream's `101`, its idle timeout and its grace in the drain.
//! - [`reload`]: live rules: the file watch and SIGHUP, swapping in only higher versions.
//! - [`admin`]: the admin listener (health, readiness, metrics, running rules).
//! - [`access`]: the access log in a conventional format (`--access-log-format`), formatted
//!   on its writer thread.
//! - [`otel`]: a span per request over OTLP, the caller's `traceparent` continued upstream.
//! - [`demo`]: the built-in demo upstream.

pub mod access;
pub(crate) mod admin;
pub(crate) mod admin_blocks;
pub mod admin_guard;
pub mod app;
pub(crate) mod boxed;
pub(crate) mod bufs;
pub(crate) mod concurrency;
pub mod config;
pub(crate) mod dashboard;
pub mod demo;
pub mod demo_instances;
pub(crate) mod managed;
pub mod otel;
pub(crate) mod proxy;
pub mod regions;
pub mod reload;
pub mod request;
pub mod respond;
pub mod server;
pub(crate) mod shard;
pub mod store_url;
pub(crate) mod upgrade;
