//! What the operator sees of a running gateway: one Prometheus registry per gateway
//! (`metrics`) and sampled log lines for events that could come once per request
//! (`logsample`). The store, the rules watch and the gateway all report here.

pub mod logsample;
pub mod metrics;
