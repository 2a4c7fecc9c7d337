//! Security limits checked in their home Region's store. A login limit shared out by Region
//! would let an attacker spend a full allowance in every Region, so such a limit names one
//! Region and every Region's gateways check its buckets there.
//!
//! A request that pays buckets in two stores is checked in both at once; when one refuses, what
//! the others took is refunded, so the request still pays all or nothing. Between the checks
//! and the refund another request can see those buckets short: a rare, brief refusal that
//! would not have happened in one store, never an admission that should not have.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::future::join_all;
use tollgate_limit::bucket::BucketVerdict;
use tollgate_store::{
    Adjusted, Batch, BoxFuture, CheckFuture, CheckItem, Outcome, Source, Store, StoreError,
};

/// Which Region's store checks a limit, by the limit's index in the running rules: `None` for
/// this Region's own store.
pub(crate) type HomeOf = Arc<dyn Fn(u16) -> Option<Arc<str>> + Send + Sync>;

/// This Region's store in front, the home Regions' stores behind.
pub(crate) struct HomeRouted {
    local: Arc<dyn Store>,
    homes: BTreeMap<Arc<str>, Arc<dyn Store>>,
    home_of: HomeOf,
}

impl HomeRouted {
    pub fn new(
        local: Arc<dyn Store>,
        homes: BTreeMap<Arc<str>, Arc<dyn Store>>,
        home_of: HomeOf,
    ) -> HomeRouted {
        HomeRouted {
            local,
            homes,
            home_of,
        }
    }

    /// The home Region of each item, `None` for this Region's store; `None` as a whole, without
    /// allocating, for the usual batch that has no item homed elsewhere.
    fn split(&self, batch: &[CheckItem]) -> Option<Vec<Option<Arc<str>>>> {
        let home = |i: &CheckItem| (self.home_of)(i.limit).filter(|h| self.homes.contains_key(h));
        let first = batch.iter().position(|i| home(i).is_some())?;
        Some(
            batch
                .iter()
                .enumerate()
                .map(|(j, i)| if j < first { None } else { home(i) })
                .collect(),
        )
    }

    fn store(&self, home: &Option<Arc<str>>) -> &Arc<dyn Store> {
        match home {
            Some(h) => &self.homes[h],
            None => &self.local,
        }
    }
}

/// The items of one store, with their places in the whole batch.
struct Group {
    home: Option<Arc<str>>,
    places: Vec<usize>,
    batch: Batch,
}

fn groups(batch: &[CheckItem], routes: &[Option<Arc<str>>]) -> Vec<Group> {
    let mut out: Vec<Group> = Vec::new();
    for (i, (item, home)) in batch.iter().zip(routes).enumerate() {
        let g = match out.iter_mut().position(|g| &g.home == home) {
            Some(p) => &mut out[p],
            None => {
                out.push(Group {
                    home: home.clone(),
                    places: Vec::new(),
                    batch: Batch::new(),
                });
                out.last_mut().expect("just pushed")
            }
        };
        g.places.push(i);
        g.batch.push(item.clone());
    }
    out
}

/// One outcome for the whole batch, each verdict in its item's place.
fn merge(len: usize, groups: &[Group], outcomes: &[Outcome], admitted: bool) -> Outcome {
    let mut verdicts: Vec<Option<BucketVerdict>> = vec![None; len];
    let mut leased = 0u64;
    let mut source = Source::Store;
    let mut now_us = 0;
    for (g, o) in groups.iter().zip(outcomes) {
        for (j, &place) in g.places.iter().enumerate() {
            verdicts[place] = Some(o.buckets[j]);
            if o.is_leased(j) && place < 64 {
                leased |= 1 << place;
            }
        }
        if source == Source::Store {
            source = o.source;
        }
        if g.home.is_none() {
            now_us = o.now_us;
        }
    }
    Outcome {
        admitted,
        now_us,
        buckets: verdicts
            .into_iter()
            .map(|v| v.expect("every item is in one group"))
            .collect(),
        source,
        leased,
    }
}

impl Store for HomeRouted {
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        let Some(routes) = self.split(batch) else {
            return self.local.check(batch);
        };
        CheckFuture::Boxed(Box::pin(async move {
            let groups = groups(batch, &routes);
            let checks = groups.iter().map(|g| self.store(&g.home).check(&g.batch));
            let results: Vec<Result<Outcome, StoreError>> = join_all(checks).await;
            let all_admitted = results.iter().all(|r| r.as_ref().is_ok_and(|o| o.admitted));
            if !all_admitted {
                // Give back what the stores that admitted took: the request pays nothing.
                let refunds = groups.iter().zip(&results).filter_map(|(g, r)| match r {
                    Ok(o) if o.admitted => Some(async move {
                        if let Err(e) = self.store(&g.home).refund(&g.batch, o).await {
                            tracing::warn!(home = ?g.home, error = %e, "refund after a refusal in another Region's store failed");
                        }
                    }),
                    _ => None,
                });
                join_all(refunds).await;
            }
            let mut outcomes = Vec::with_capacity(results.len());
            for r in results {
                outcomes.push(r?);
            }
            Ok(merge(batch.len(), &groups, &outcomes, all_admitted))
        }))
    }

    fn kind(&self) -> &'static str {
        self.local.kind()
    }

    fn ping(&self) -> CheckFuture<'_> {
        self.local.ping()
    }

    fn blocks(&self) -> tollgate_store::BoxFuture<'_, Result<tollgate_store::Blocks, StoreError>> {
        self.local.blocks()
    }

    fn lift<'a>(&'a self, bucket: &'a str) -> tollgate_store::BoxFuture<'a, Result<bool, StoreError>> {
        self.local.lift(bucket)
    }

    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
        let Some(routes) = self.split(batch) else {
            return self.local.adjust(batch, outcome, units);
        };
        Box::pin(async move {
            if outcome.buckets.len() != batch.len() || units.len() != batch.len() {
                return Err(StoreError::Protocol(format!(
                    "a change of {} buckets with an outcome of {} and {} amounts",
                    batch.len(),
                    outcome.buckets.len(),
                    units.len()
                )));
            }
            let groups = groups(batch, &routes);
            let parts: Vec<(Outcome, Vec<i64>)> = groups
                .iter()
                .map(|g| {
                    (
                        outcome.part(&g.places),
                        g.places.iter().map(|&p| units[p]).collect(),
                    )
                })
                .collect();
            let changes = groups
                .iter()
                .zip(&parts)
                .map(|(g, (o, u))| self.store(&g.home).adjust(&g.batch, o, u));
            let mut out = Adjusted::none(batch.len());
            for (g, r) in groups.iter().zip(join_all(changes).await) {
                let got = r?;
                out.now_us = out.now_us.max(got.now_us);
                for (j, &i) in g.places.iter().enumerate() {
                    out.balances[i] = got.balances[j];
                }
            }
            Ok(out)
        })
    }

    fn heartbeat<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Option<u32>, StoreError>> {
        self.local.heartbeat(instance)
    }

    fn remote(&self) -> bool {
        self.local.remote()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_limit::batch::FailurePolicy;
    use tollgate_limit::bucket::{BucketParams, Charge, Rate};
    use tollgate_limit::clock::ManualClock;
    use tollgate_store::memory::MemoryStore;

    fn item(name: &str, limit: u16, burst: u64) -> CheckItem {
        let params = BucketParams::new(
            Rate {
                tokens: 1,
                period_us: 60_000_000,
            },
            burst,
        )
        .unwrap();
        CheckItem::new(
            name.into(),
            Charge {
                params,
                cost: 1,
                shadow: false,
            },
            limit,
            FailurePolicy::Closed,
        )
    }

    /// Limit 1 lives in Region A's store, everything else here.
    fn routed() -> (HomeRouted, Arc<MemoryStore>, Arc<MemoryStore>) {
        let clock = ManualClock::new(1_000_000);
        let local = Arc::new(MemoryStore::new(clock.clone()));
        let home = Arc::new(MemoryStore::new(clock));
        let mut homes: BTreeMap<Arc<str>, Arc<dyn Store>> = BTreeMap::new();
        homes.insert("A".into(), home.clone());
        let home_of: HomeOf = Arc::new(|li| (li == 1).then(|| Arc::from("A")));
        (HomeRouted::new(local.clone(), homes, home_of), local, home)
    }

    #[tokio::test]
    async fn a_refusal_in_either_store_leaves_the_other_untouched() {
        let (r, local, home) = routed();
        let batch: Batch = [item("rl:{k}:plan", 0, 5), item("rl:{a}:login", 1, 1)]
            .into_iter()
            .collect();
        let first = r.check(&batch).await.unwrap();
        assert!(first.admitted);
        // The login bucket is spent in A's store; the plan bucket here must not pay for a
        // refused request.
        let second = r.check(&batch).await.unwrap();
        assert!(!second.admitted);
        assert!(second.buckets[0].sufficient && !second.buckets[1].sufficient);
        let plan_only: Batch = [item("rl:{k}:plan", 0, 5)].into_iter().collect();
        let left = local.check(&plan_only).await.unwrap();
        let p = batch[0].charge.params;
        assert_eq!(
            left.buckets[0].remaining(&p),
            5 - 2,
            "one paid request and this probe"
        );
        // And the login bucket was checked in A's store only.
        let login_only: Batch = [item("rl:{a}:login", 1, 1)].into_iter().collect();
        assert!(!home.check(&login_only).await.unwrap().admitted);
        assert!(local.check(&login_only).await.unwrap().admitted);
    }

    #[tokio::test]
    async fn a_refund_goes_back_to_each_store() {
        let (r, _local, home) = routed();
        let batch: Batch = [item("rl:{a}:login", 1, 1), item("rl:{k}:plan", 0, 5)]
            .into_iter()
            .collect();
        let o = r.check(&batch).await.unwrap();
        assert!(o.admitted);
        r.refund(&batch, &o).await.unwrap();
        let login_only: Batch = [item("rl:{a}:login", 1, 1)].into_iter().collect();
        assert!(
            home.check(&login_only).await.unwrap().admitted,
            "the login token came back to A"
        );
    }
}
