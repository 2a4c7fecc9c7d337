//! A lessor and inner store in memory, on tokio's paused clock, for the tests of `Leases`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use tollgate_limit::batch::LeaseBlock;
use tollgate_limit::bucket::{BucketParams, BucketState, BucketVerdict, Charge, Rate};
use tollgate_limit::lease::{Account, Grant, HolderRecords, LeaseConfig, give_back_recorded, lease_recorded};
use tollgate_store::guard::FleetSize;
use tollgate_store::lease::{GiveBackReply, LeaseReply, Leases, Lessor};
use tollgate_store::{
    Adjusted, BoxFuture, CheckFuture, CheckItem, FailurePolicy, Outcome, Source, Store, StoreError,
};
use tollgate_telemetry::metrics::Metrics;

/// A store in memory on tokio's (paused) clock: leases by `limit::lease`, checks answered
/// as told, and a switch that makes every lease call fail.
pub struct Fake {
    pub origin: Instant,
    pub bucket: Mutex<Option<BucketState>>,
    pub records: Mutex<HolderRecords>,
    pub fail: AtomicBool,
    /// Lease answers take this long (virtual ms).
    pub delay_ms: AtomicU64,
    pub leases: AtomicU64,
    pub given: Mutex<Vec<u64>>,
    pub checks: AtomicU64,
    pub refuse_checks: AtomicBool,
    /// The keys of every batch refunded through this store.
    pub refunded: Mutex<Vec<Vec<String>>>,
}

impl Fake {
    pub fn new() -> Arc<Fake> {
        Arc::new(Fake {
            origin: Instant::now(),
            bucket: Mutex::new(None),
            records: Mutex::new(HolderRecords::new()),
            fail: AtomicBool::new(false),
            delay_ms: AtomicU64::new(0),
            leases: AtomicU64::new(0),
            given: Mutex::new(Vec::new()),
            checks: AtomicU64::new(0),
            refuse_checks: AtomicBool::new(false),
            refunded: Mutex::new(Vec::new()),
        })
    }

    fn now(&self) -> u64 {
        // A store clock far from the gateway's, as Redis TIME is.
        1_700_000_000_000_000 + self.origin.elapsed().as_micros() as u64
    }
}

impl Lessor for Fake {
    fn lease<'a>(
        &'a self,
        _key: &'a str,
        p: &'a BucketParams,
        block: u64,
        cycle_us: u64,
        acct: Account<'a>,
    ) -> BoxFuture<'a, Result<LeaseReply, StoreError>> {
        Box::pin(async move {
            self.leases.fetch_add(1, Ordering::SeqCst);
            let delay = self.delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            if self.fail.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable("connection refused".into()));
            }
            let now = self.now();
            let cfg = LeaseConfig::new(*p, block, 1).unwrap();
            let mut b = self.bucket.lock().unwrap();
            let mut recs = self.records.lock().unwrap();
            let (grant, recorded) = lease_recorded(&cfg, &mut b, &mut recs, &acct, now);
            let grant = match grant {
                Grant::Denied { .. } => Grant::Denied {
                    until_us: now + cycle_us,
                },
                g => g,
            };
            Ok(LeaseReply {
                grant,
                now_us: now,
                units_left: b.unwrap().tokens,
                recorded,
            })
        })
    }

    fn give_back<'a>(
        &'a self,
        _key: &'a str,
        p: &'a BucketParams,
        tokens: u64,
        acct: Account<'a>,
    ) -> BoxFuture<'a, Result<GiveBackReply, StoreError>> {
        Box::pin(async move {
            let now = self.now();
            let mut b = self.bucket.lock().unwrap();
            let mut recs = self.records.lock().unwrap();
            let recorded = give_back_recorded(p, &mut b, &mut recs, &acct, tokens, now);
            self.given.lock().unwrap().push(tokens);
            Ok(GiveBackReply {
                now_us: now,
                units_left: b.unwrap().tokens,
                recorded,
            })
        })
    }
}

impl Store for Fake {
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        let admitted = !self.refuse_checks.load(Ordering::SeqCst);
        CheckFuture::ready(Ok(Outcome {
            admitted,
            now_us: self.now(),
            buckets: batch
                .iter()
                .map(|_| BucketVerdict {
                    sufficient: admitted,
                    tokens: 0,
                    wait_us: Some(if admitted { 0 } else { 5_000_000 }),
                    blocked: false,
                })
                .collect(),
            source: Source::Store,
            leased: 0,
        }))
    }

    fn kind(&self) -> &'static str {
        "fake"
    }

    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
        assert_eq!(batch.len(), outcome.buckets.len());
        assert_eq!(batch.len(), units.len());
        assert_eq!(outcome.leased, 0, "leased items never reach the store's refund");
        self.refunded
            .lock()
            .unwrap()
            .push(batch.iter().map(|i| i.key.to_string()).collect());
        Box::pin(std::future::ready(Ok(Adjusted::none(batch.len()))))
    }
}

pub fn leases(fake: &Arc<Fake>) -> (Arc<Leases>, Arc<Metrics>) {
    let m = Metrics::new();
    let l = Leases::new(
        fake.clone(),
        fake.clone(),
        Arc::new(FleetSize::fixed(1)),
        m.clone(),
        Duration::from_millis(3),
    );
    (l, m)
}

pub fn item(rate: &str, burst: u64, block: u64, cost: u64) -> CheckItem {
    let params = BucketParams::new(Rate::parse(rate).unwrap(), burst).unwrap();
    let mut i = CheckItem::new(
        "rl:{kbig}:plan".into(),
        Charge {
            params,
            cost,
            shadow: false,
        },
        0,
        FailurePolicy::Local,
    );
    i.lease = Some(LeaseBlock::Fixed(block));
    i
}

pub async fn settle(l: &Leases) {
    while l.calls_in_flight() > 0 {
        tokio::time::sleep(Duration::from_micros(10)).await;
    }
}
