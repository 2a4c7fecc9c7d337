//! Seats of limits on requests in flight (`"concurrent": N`): one per request, taken before it
//! is forwarded and given back when its answer ends or its client goes away. In memory for one
//! gateway; in Redis for a fleet, where each seat carries a lease that this gateway renews
//! while the request lasts, so the seats of a gateway killed mid-request come back when their
//! leases end.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::{ClientLike, LuaInterface, SortedSetsInterface};
use tokio::sync::watch;

use crate::{BoxFuture, StoreError};

const TAKE: &str = include_str!("../../lua/seats.lua");
const RENEW: &str = include_str!("../../lua/seats_renew.lua");

/// A taken seat; dropping it gives it back.
pub struct Seat {
    give_back: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Seat {
    fn new(f: impl FnOnce() + Send + Sync + 'static) -> Seat {
        Seat {
            give_back: Some(Box::new(f)),
        }
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        if let Some(f) = self.give_back.take() {
            f();
        }
    }
}

impl std::fmt::Debug for Seat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Seat")
    }
}

/// What asking for a seat gave.
#[derive(Debug)]
pub enum Taken {
    Seat(Seat),
    /// Every seat is taken; `in_use` of them.
    Full {
        in_use: u32,
    },
}

/// Where the seats of limits on requests in flight are kept.
pub trait Seats: Send + Sync + 'static {
    /// One seat of `key`'s limit of `max`.
    fn take<'a>(&'a self, key: &'a str, max: u32) -> BoxFuture<'a, Result<Taken, StoreError>>;
}

/// The seats of one gateway, in its memory.
#[derive(Default)]
pub struct MemorySeats {
    taken: Arc<Mutex<HashMap<Arc<str>, u32>>>,
}

impl MemorySeats {
    pub fn new() -> MemorySeats {
        MemorySeats::default()
    }

    fn take_now(&self, key: &str, max: u32) -> Taken {
        let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        let key: Arc<str> = match taken.get_key_value(key) {
            Some((k, _)) => k.clone(),
            None => Arc::from(key),
        };
        let n = taken.entry(key.clone()).or_insert(0);
        if *n >= max {
            return Taken::Full { in_use: *n };
        }
        *n += 1;
        let map = self.taken.clone();
        Taken::Seat(Seat::new(move || {
            let mut taken = map.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(n) = taken.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    taken.remove(&key);
                }
            }
        }))
    }

    /// Seats taken now for `key`.
    pub fn in_use(&self, key: &str) -> u32 {
        self.taken
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .copied()
            .unwrap_or(0)
    }
}

impl Seats for MemorySeats {
    fn take<'a>(&'a self, key: &'a str, max: u32) -> BoxFuture<'a, Result<Taken, StoreError>> {
        let t = self.take_now(key, max);
        Box::pin(std::future::ready(Ok(t)))
    }
}

/// The seats this gateway holds in Redis, by key: what the renewal extends.
type Held = Arc<Mutex<HashMap<Arc<str>, Vec<String>>>>;

/// Seats in Redis (`lua/seats.lua`), shared by every gateway of the fleet.
pub struct RedisSeats {
    client: Client,
    lease: Duration,
    timeout: Duration,
    /// Names this gateway's seats apart from every other gateway's.
    prefix: String,
    next: AtomicU64,
    held: Held,
}

impl RedisSeats {
    /// Seats on `client`'s store with `lease`; a take waits at most `timeout`. Start
    /// [`RedisSeats::renew`] beside it.
    pub fn new(client: Client, lease: Duration, timeout: Duration) -> Arc<RedisSeats> {
        let _task = client.connect();
        Arc::new(RedisSeats {
            client,
            lease,
            timeout,
            prefix: format!("{:016x}", rand::random::<u64>()),
            next: AtomicU64::new(0),
            held: Arc::default(),
        })
    }

    /// Renews the leases of every seat still held, every third of a lease, until stopped.
    pub async fn renew(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.lease / 3);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            let held: Vec<(Arc<str>, Vec<String>)> = self
                .held
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            for (key, seats) in held {
                let mut args = vec![self.lease.as_millis().to_string()];
                args.extend(seats);
                let r: Result<i64, _> = self.client.eval(RENEW, vec![key.to_string()], args).await;
                if let Err(e) = r {
                    tracing::debug!(error = %e.details(), "renewing seats failed; they expire with their lease");
                }
            }
        }
    }

    async fn take_remote(&self, key: &str, max: u32) -> Result<Taken, StoreError> {
        let seat = format!("{}:{}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed));
        let args = vec![max.to_string(), seat.clone(), self.lease.as_millis().to_string()];
        let call = self
            .client
            .eval::<Vec<i64>, _, _, _>(TAKE, vec![key.to_string()], args);
        let reply = match tokio::time::timeout(self.timeout, call).await {
            Err(_) => return Err(StoreError::Timeout),
            Ok(Err(e)) => return Err(StoreError::Unavailable(e.details().to_string())),
            Ok(Ok(r)) => r,
        };
        match reply.as_slice() {
            [0, n] => Ok(Taken::Full { in_use: *n as u32 }),
            [1, _] => {
                let key: Arc<str> = Arc::from(key);
                self.held
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(key.clone())
                    .or_default()
                    .push(seat.clone());
                let (held, client) = (self.held.clone(), self.client.clone());
                Ok(Taken::Seat(Seat::new(move || give_back(held, client, key, seat))))
            }
            other => Err(StoreError::Protocol(format!("seats.lua answered {other:?}"))),
        }
    }
}

/// Forgets a seat and removes it from the store in the background; if the store can't be
/// reached, its lease ends it.
fn give_back(held: Held, client: Client, key: Arc<str>, seat: String) {
    {
        let mut h = held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(seats) = h.get_mut(&key) {
            seats.retain(|s| *s != seat);
            if seats.is_empty() {
                h.remove(&key);
            }
        }
    }
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            let r: Result<i64, _> = client.zrem(&*key, seat).await;
            if let Err(e) = r {
                tracing::debug!(error = %e.details(), "giving a seat back failed; its lease ends it");
            }
        });
    }
}

impl Seats for RedisSeats {
    fn take<'a>(&'a self, key: &'a str, max: u32) -> BoxFuture<'a, Result<Taken, StoreError>> {
        Box::pin(self.take_remote(key, max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_seats_come_back_when_dropped() {
        let s = MemorySeats::new();
        let a = s.take("k", 2).await.unwrap();
        let b = s.take("k", 2).await.unwrap();
        assert!(matches!(s.take("k", 2).await.unwrap(), Taken::Full { in_use: 2 }));
        assert!(matches!(s.take("other", 2).await.unwrap(), Taken::Seat(_)));
        drop(a);
        assert_eq!(s.in_use("k"), 1);
        let c = s.take("k", 2).await.unwrap();
        assert!(matches!(c, Taken::Seat(_)));
        drop((b, c));
        assert_eq!(s.in_use("k"), 0);
    }
}
