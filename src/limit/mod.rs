//! Limiting without I/O: bucket math, the clock seam, what a check asks and answers (`batch`),
//! decisions and their headers, and leased blocks for hot keys. Nothing here knows the rules
//! file, a socket or a runtime.

pub mod batch;
pub mod bucket;
pub mod clock;
pub mod decision;
pub mod headers;
pub mod lease;
