//! What this gateway has seen of `block_for` limits' blocks: the ones its checks started and
//! the ones that refused its requests, for the `tollgate_blocks_started_total` and
//! `tollgate_blocks_in_force` metrics. The store holds the blocks; this is only a view.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tollgate_rules::Snapshot;
use tollgate_store::Outcome;

use super::Gateway;

/// Each block seen, by limit and bucket name: the microsecond it ends, on the store's clock.
type Seen = HashMap<(Arc<str>, Arc<str>), u64>;

#[derive(Default)]
pub(crate) struct SeenBlocks(Mutex<Seen>);

impl Gateway {
    /// Notes the blocks a check started or met. Only a batch with a blocking limit's bucket
    /// costs more than one pass over it.
    pub(super) fn note_blocks(
        &self,
        snap: &Snapshot,
        batch: &[tollgate_store::CheckItem],
        outcome: &Outcome,
    ) {
        if !batch.iter().any(|i| i.charge.params.block_us > 0) {
            return;
        }
        let now = outcome.now_us;
        let mut seen = self
            .blocks_seen
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (item, v) in batch.iter().zip(&outcome.buckets) {
            if item.charge.params.block_us == 0 || v.sufficient {
                continue;
            }
            let name = snap.limits[item.limit as usize].name.clone();
            let end = if v.blocked {
                now + v.wait_us.unwrap_or(0)
            } else {
                self.metrics
                    .blocks_started
                    .get_or_create(&tollgate_telemetry::metrics::LimitLabel { limit: name.clone() })
                    .inc();
                now + item.charge.params.block_us
            };
            seen.insert((name, item.key.clone()), end);
        }
        self.count_in_force(&mut seen, now);
    }

    /// Replaces what this gateway has seen with the store's list, as of the store's `now`.
    pub(crate) fn blocks_listed(&self, list: &[(Arc<str>, Arc<str>, u64)], now: u64) {
        let mut seen = self
            .blocks_seen
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.clear();
        for (limit, bucket, end) in list {
            seen.insert((limit.clone(), bucket.clone()), *end);
        }
        self.count_in_force(&mut seen, now);
    }

    /// Forgets a block an operator lifted.
    pub(crate) fn block_lifted(&self, limit: &str, bucket: &str) {
        let mut seen = self
            .blocks_seen
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.retain(|(l, b), _| !(&**l == limit && &**b == bucket));
        self.count_in_force(&mut seen, 0);
    }

    fn count_in_force(&self, seen: &mut Seen, now: u64) {
        seen.retain(|_, end| *end > now);
        let mut per: HashMap<&Arc<str>, i64> = HashMap::new();
        for (limit, _) in seen.keys() {
            *per.entry(limit).or_default() += 1;
        }
        let gauges = &self.metrics.blocks_in_force;
        // Limits whose blocks all ended go back to 0 rather than keep their last count.
        let rules = self.rules.load();
        for l in rules.limits.iter().filter(|l| l.block_us > 0) {
            gauges
                .get_or_create(&tollgate_telemetry::metrics::LimitLabel {
                    limit: l.name.clone(),
                })
                .set(per.get(&l.name).copied().unwrap_or(0));
        }
    }
}
