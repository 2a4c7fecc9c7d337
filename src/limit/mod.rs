//! Limiting without I/O: bucket math, the clock seam, request plans, decisions and their headers.

pub mod bucket;
pub mod clock;
pub mod decision;
pub mod headers;
pub mod plan;
