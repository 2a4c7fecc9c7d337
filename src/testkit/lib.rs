//! Tollgate's test kit: what the workspace's tests and benches share and the product never
//! links (`tests/layers.rs` holds the binary's dependency tree to that).
//!
//! - [`stores`]: stores that fail on purpose, to test what stands in front of a store.
//! - [`lease_fake`]: a lessor and inner store in memory on tokio's paused clock, for `Leases`.
//! - [`lease_load`]: a hot key on real lease clients and a real redis-server.
//! - The process handles are `tollgate fleet`'s own (`tollgate_fleet::procs`), re-exported so
//!   a test starts redis-server the way a fleet run does.

pub mod lease_fake;
pub mod lease_load;
pub mod stores;

pub use tollgate_fleet::procs::{Redis, find_binary, free_port, redis_server_args};

/// What a benchmark prints first so its figures can be read against the host: the cores and
/// the load average when it started.
pub fn machine_line() -> String {
    let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    format!(
        "machine: {} cores, load average at start {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    )
}
