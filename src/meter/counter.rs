//! The gateway's side of metering: a running count of admitted requests per key for this
//! gateway identity, and the loop that appends the keys that moved as records every interval.
//!
//! Counting is one relaxed atomic add on a counter the request path holds already; nothing on
//! the request path waits on the sink. A flush that fails is retried with the newer totals at
//! the next interval, so a slow or absent sink delays records but loses none while the
//! gateway runs.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::record::{Identity, Kind, Record};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where records go: the Redis stream or the SQLite file. All of a call's records are
/// appended or none is, so sequence numbers stay whole.
pub trait Sink: Send + Sync {
    fn append<'a>(&'a self, records: &'a [Record]) -> BoxFuture<'a, Result<(), String>>;
}

/// One gateway identity's running totals.
pub struct Meter {
    identity: Identity,
    counters: Mutex<HashMap<Arc<str>, Arc<AtomicU64>>>,
    /// Held across a flush, so two flushes never interleave their sequence numbers.
    flushing: tokio::sync::Mutex<Flushed>,
}

#[derive(Default)]
struct Flushed {
    totals: HashMap<Arc<str>, u64>,
    /// The last sequence number written.
    seq: u64,
    /// The key of the last usage record written, repeated when nothing moved.
    last: Option<(Arc<str>, u64)>,
}

impl Meter {
    pub fn new(identity: Identity) -> Arc<Meter> {
        Arc::new(Meter {
            identity,
            counters: Mutex::new(HashMap::new()),
            flushing: tokio::sync::Mutex::new(Flushed::default()),
        })
    }

    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The counter of key `id`, the same one across rules reloads, so a reload never restarts
    /// a key's running total.
    pub fn counter(&self, id: &Arc<str>) -> Arc<AtomicU64> {
        let mut c = self.counters.lock().unwrap_or_else(PoisonError::into_inner);
        c.entry(id.clone()).or_default().clone()
    }

    /// Every key's running total now.
    pub fn totals(&self) -> Vec<(Arc<str>, u64)> {
        let c = self.counters.lock().unwrap_or_else(PoisonError::into_inner);
        let mut t: Vec<_> = c
            .iter()
            .map(|(k, v)| (k.clone(), v.load(Ordering::Relaxed)))
            .collect();
        t.sort();
        t
    }

    /// Appends one usage record per key whose total moved since the last flush that landed.
    /// Returns how many were written.
    pub async fn flush(&self, sink: &dyn Sink) -> Result<usize, String> {
        self.write(sink, false).await
    }

    /// The last flush and then the clean end of this identity.
    pub async fn end(&self, sink: &dyn Sink) -> Result<usize, String> {
        self.write(sink, true).await
    }

    fn usage(&self, seq: u64, key: &str, total: u64) -> Record {
        Record {
            identity: self.identity.clone(),
            seq,
            kind: Kind::Usage {
                key: key.to_string(),
                total,
            },
        }
    }

    async fn write(&self, sink: &dyn Sink, end: bool) -> Result<usize, String> {
        let mut done = self.flushing.lock().await;
        let mut records = Vec::new();
        let mut seq = done.seq;
        let mut moved = Vec::new();
        for (key, total) in self.totals() {
            // A key is known from the rules before it is used: nothing to say until it moves.
            if total > done.totals.get(&key).copied().unwrap_or(0) {
                seq += 1;
                records.push(self.usage(seq, &key, total));
                moved.push((key, total));
            }
        }
        // An idle identity repeats its last total under a new sequence number: it changes no
        // sum, and it tells the consumer this gateway is alive, not gone without an end.
        if records.is_empty()
            && !end
            && let Some((key, total)) = &done.last
        {
            seq += 1;
            records.push(self.usage(seq, key, *total));
        }
        if end {
            seq += 1;
            records.push(Record {
                identity: self.identity.clone(),
                seq,
                kind: Kind::End,
            });
        }
        if records.is_empty() {
            return Ok(0);
        }
        sink.append(&records).await?;
        done.seq = seq;
        if let Some(last) = moved.last() {
            done.last = Some(last.clone());
        }
        done.totals.extend(moved);
        Ok(records.len())
    }
}

/// Flushes every `interval` until `stop` turns true, then writes the final records and the
/// end record. A failed flush is logged and retried at the next interval.
pub async fn run(
    meter: Arc<Meter>,
    sink: Arc<dyn Sink>,
    interval: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = meter.flush(&*sink).await {
                    tracing::warn!(error = %e, "usage records not written; retrying at the next interval");
                }
            }
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    break;
                }
            }
        }
    }
    // The store may be coming back from an outage: the last records are worth a few tries.
    let mut pause = Duration::from_millis(100);
    for attempt in 1..=END_ATTEMPTS {
        match meter.end(&*sink).await {
            Ok(_) => {
                tracing::info!(identity = %meter.identity(), "usage records ended cleanly");
                return;
            }
            Err(e) if attempt == END_ATTEMPTS => {
                tracing::error!(identity = %meter.identity(), error = %e, "final usage records not written");
            }
            Err(_) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// How often the last records are tried at shutdown (about 5 s in all).
const END_ATTEMPTS: u32 = 8;

#[cfg(test)]
mod tests {
    use super::*;

    /// Keeps what it was given; fails while `fail` is set.
    #[derive(Default)]
    struct Kept {
        records: Mutex<Vec<Record>>,
        fail: std::sync::atomic::AtomicBool,
    }

    impl Sink for Kept {
        fn append<'a>(&'a self, records: &'a [Record]) -> BoxFuture<'a, Result<(), String>> {
            Box::pin(async move {
                if self.fail.load(Ordering::Relaxed) {
                    return Err("down".into());
                }
                self.records.lock().unwrap().extend_from_slice(records);
                Ok(())
            })
        }
    }

    fn usage(r: &Record) -> (u64, &str, u64) {
        match &r.kind {
            Kind::Usage { key, total } => (r.seq, key, *total),
            Kind::End => (r.seq, "(end)", 0),
        }
    }

    #[tokio::test]
    async fn only_keys_that_moved_are_written_with_running_totals() {
        let m = Meter::new(Identity::new("gw"));
        let sink = Kept::default();
        let (a, b) = (m.counter(&"k-1".into()), m.counter(&"k-2".into()));
        a.fetch_add(3, Ordering::Relaxed);
        b.fetch_add(1, Ordering::Relaxed);
        assert_eq!(m.flush(&sink).await, Ok(2));
        assert_eq!(m.flush(&sink).await, Ok(1), "nothing moved: the last total again");
        a.fetch_add(2, Ordering::Relaxed);
        assert_eq!(m.flush(&sink).await, Ok(1));
        assert_eq!(m.end(&sink).await, Ok(1));
        let got = sink.records.lock().unwrap().clone();
        let got: Vec<_> = got.iter().map(usage).collect();
        assert_eq!(
            got,
            [
                (1, "k-1", 3),
                (2, "k-2", 1),
                (3, "k-2", 1),
                (4, "k-1", 5),
                (5, "(end)", 0)
            ]
        );
    }

    #[tokio::test]
    async fn a_failed_flush_keeps_its_sequence_and_catches_up() {
        let m = Meter::new(Identity::new("gw"));
        let sink = Kept::default();
        let a = m.counter(&"k-1".into());
        a.fetch_add(1, Ordering::Relaxed);
        sink.fail.store(true, Ordering::Relaxed);
        assert!(m.flush(&sink).await.is_err());
        a.fetch_add(1, Ordering::Relaxed);
        sink.fail.store(false, Ordering::Relaxed);
        assert_eq!(m.flush(&sink).await, Ok(1));
        let got = sink.records.lock().unwrap().clone();
        assert_eq!(got.iter().map(usage).collect::<Vec<_>>(), [(1, "k-1", 2)]);
    }

    #[tokio::test]
    async fn keys_never_used_write_nothing() {
        let m = Meter::new(Identity::new("gw"));
        let sink = Kept::default();
        let _unused = m.counter(&"k-1".into());
        assert_eq!(m.flush(&sink).await, Ok(0));
        assert_eq!(m.end(&sink).await, Ok(1), "only the end record");
        let got = sink.records.lock().unwrap().clone();
        assert_eq!(got.iter().map(usage).collect::<Vec<_>>(), [(1, "(end)", 0)]);
    }

    #[tokio::test]
    async fn the_same_key_keeps_one_counter() {
        let m = Meter::new(Identity::new("gw"));
        m.counter(&"k-1".into()).fetch_add(1, Ordering::Relaxed);
        m.counter(&"k-1".into()).fetch_add(1, Ordering::Relaxed);
        assert_eq!(m.totals(), [("k-1".into(), 2)]);
    }
}
