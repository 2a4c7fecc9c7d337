//! Limiting without I/O: bucket math, the clock seam, what a check asks and answers (`batch`),
//! decisions, and leased blocks for hot keys. Nothing here knows the rules file, HTTP, a socket
//! or a runtime: this crate has no such dependency, so the compiler keeps it that way.

pub mod batch;
pub mod bucket;
pub mod clock;
pub mod decision;
pub mod lease;
