//! Limiting without I/O: bucket math, the clock seam, what a check asks and answers (`batch`),
//! decisions, leased blocks for hot keys, and the adaptive concurrency limit of an upstream
//! (`adaptive`). Nothing here knows the rules file, HTTP, a socket or a runtime: this crate
//! has no such dependency, so the compiler keeps it that way.

pub mod adaptive;
pub mod batch;
pub mod bucket;
pub mod clock;
pub mod decision;
pub mod lease;
