//! Limiting without I/O: bucket math, the clock seam, request plans, decisions and their headers,
//! and leased blocks for hot keys.

pub mod bucket;
pub mod clock;
pub mod decision;
pub mod headers;
pub mod lease;
pub mod plan;
