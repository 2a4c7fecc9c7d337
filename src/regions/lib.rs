//! One limit shared by several Regions: what a Region's agent decides at each rebalance
//! (`agent`, pure and shared with the live agent) and the fluid model that runs those
//! decisions through a shift in demand and a lost or cut-off Region (`sim`).

pub mod agent;
pub mod sim;

pub use agent::{Agent, Design, Params, ReclaimRule, ShareRecord, View};
pub use sim::{Report, Run, Scenario, UnknownRun};
