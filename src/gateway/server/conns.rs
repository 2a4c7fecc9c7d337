//! The caps on client connections (`--max-connections`, `--max-connections-per-ip`): which
//! connections are open, which sit idle between requests, and which idle one gives way to a
//! newcomer when a cap is reached.
//!
//! A full cap closes the connection that has been idle longest (of the newcomer's IP, for the
//! per-IP cap), so clients that keep connections open and silent can't lock out clients that
//! want to send a request now. With none idle the newcomer is refused: closed at once, before
//! anything is read from it (it may not have sent a request yet, and on TLS nothing could be
//! said without a handshake). A connection counts as idle from its accept, during a TLS
//! handshake, and whenever no request of its is in flight, including while a next head
//! arrives (a slow head can't hold a place either).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Notify;
use tollgate_telemetry::metrics::{CapLabel, ShardLabel};

const MAX: &str = "max_connections";
const PER_IP: &str = "max_connections_per_ip";

/// Where refusals and evictions are counted, and open and idle connections shown (the
/// gateway's metrics, or nowhere).
#[derive(Clone, Default)]
pub(crate) struct ConnCounters {
    pub refused: Family<CapLabel, Counter>,
    pub evicted: Family<CapLabel, Counter>,
    pub open: Gauge,
    pub idle: Gauge,
    /// Connections accepted, by shard (counted whether or not a cap is set).
    pub accepted: Family<ShardLabel, Counter>,
    /// Connections closed for their PROXY protocol header, by reason.
    pub proxy_refused: Family<tollgate_telemetry::metrics::ReasonLabel, Counter>,
}

/// The open connections of one listener under its caps.
pub(crate) struct Conns {
    max: Option<usize>,
    per_ip: Option<usize>,
    counters: ConnCounters,
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    /// Ids, and the order in which connections became idle.
    next: u64,
    open: HashMap<u64, Entry>,
    /// Idle connections by the moment they became idle: the first is the oldest.
    idle: BTreeMap<u64, u64>,
    idle_by_ip: BTreeMap<(IpAddr, u64), u64>,
    per_ip: HashMap<IpAddr, usize>,
}

struct Entry {
    ip: IpAddr,
    /// Requests in flight (h2 has several); 0 is idle.
    busy: u32,
    /// When it last became idle, its key in `idle`.
    idle_since: u64,
    close: Arc<Notify>,
}

/// Why a connection was refused: the cap that was full with none idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Max,
    PerIp,
}

impl Refused {
    pub fn cap(self) -> &'static str {
        match self {
            Refused::Max => MAX,
            Refused::PerIp => PER_IP,
        }
    }
}

impl Conns {
    /// `None` when neither cap is set: then nothing is tracked and nothing is paid per request.
    pub fn new(max: Option<u32>, per_ip: Option<u32>, counters: ConnCounters) -> Option<Arc<Conns>> {
        if max.is_none() && per_ip.is_none() {
            return None;
        }
        Some(Arc::new(Conns {
            max: max.map(|n| n as usize),
            per_ip: per_ip.map(|n| n as usize),
            counters,
            table: Mutex::new(Table::default()),
        }))
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the table, then shows its counts.
    fn with<T>(&self, f: impl FnOnce(&mut Table) -> T) -> T {
        let mut t = self.table();
        let r = f(&mut t);
        self.counters.open.set(t.open.len() as i64);
        self.counters.idle.set(t.idle.len() as i64);
        r
    }

    /// Takes a place for a new connection from `ip`, closing the oldest idle connection when a
    /// cap is full; refused when a full cap has none idle.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<ConnEntry, Refused> {
        let mut t = self.table();
        if let Some(cap) = self.per_ip
            && t.per_ip.get(&ip).copied().unwrap_or(0) >= cap
        {
            let oldest = t
                .idle_by_ip
                .range((ip, 0)..=(ip, u64::MAX))
                .next()
                .map(|(_, id)| *id);
            match oldest {
                Some(id) => {
                    t.evict(id);
                    self.counters.evicted.get_or_create(&cap_label(PER_IP)).inc();
                }
                None => {
                    drop(t);
                    self.counters.refused.get_or_create(&cap_label(PER_IP)).inc();
                    return Err(Refused::PerIp);
                }
            }
        }
        if let Some(cap) = self.max
            && t.open.len() >= cap
        {
            match t.idle.first_key_value().map(|(_, id)| *id) {
                Some(id) => {
                    t.evict(id);
                    self.counters.evicted.get_or_create(&cap_label(MAX)).inc();
                }
                None => {
                    drop(t);
                    self.counters.refused.get_or_create(&cap_label(MAX)).inc();
                    return Err(Refused::Max);
                }
            }
        }
        let id = t.next;
        t.next += 1;
        let since = t.next;
        t.next += 1;
        let close = Arc::new(Notify::new());
        t.open.insert(
            id,
            Entry {
                ip,
                busy: 0,
                idle_since: since,
                close: close.clone(),
            },
        );
        t.idle.insert(since, id);
        t.idle_by_ip.insert((ip, since), id);
        *t.per_ip.entry(ip).or_insert(0) += 1;
        self.counters.open.set(t.open.len() as i64);
        self.counters.idle.set(t.idle.len() as i64);
        Ok(ConnEntry {
            conns: self.clone(),
            id,
            close,
        })
    }

    /// Connections open now.
    #[cfg(test)]
    pub fn open(&self) -> usize {
        self.table().open.len()
    }
}

fn cap_label(cap: &'static str) -> CapLabel {
    CapLabel { cap }
}

impl Table {
    /// Forgets a connection (its place is free at once) and tells its task to close it.
    fn evict(&mut self, id: u64) {
        if let Some(e) = self.remove(id) {
            e.close.notify_one();
        }
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.open.remove(&id)?;
        if e.busy == 0 {
            self.idle.remove(&e.idle_since);
            self.idle_by_ip.remove(&(e.ip, e.idle_since));
        }
        if let Some(n) = self.per_ip.get_mut(&e.ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&e.ip);
            }
        }
        Some(e)
    }

    /// Returns false when the connection was closed for a newcomer.
    fn enter(&mut self, id: u64) -> bool {
        let Some(e) = self.open.get_mut(&id) else {
            return false;
        };
        e.busy += 1;
        if e.busy == 1 {
            let (since, ip) = (e.idle_since, e.ip);
            self.idle.remove(&since);
            self.idle_by_ip.remove(&(ip, since));
        }
        true
    }

    fn leave(&mut self, id: u64, all: bool) {
        let since = self.next;
        let Some(e) = self.open.get_mut(&id) else {
            return;
        };
        if e.busy == 0 {
            return;
        }
        e.busy = if all { 0 } else { e.busy - 1 };
        if e.busy == 0 {
            e.idle_since = since;
            let ip = e.ip;
            self.next += 1;
            self.idle.insert(since, id);
            self.idle_by_ip.insert((ip, since), id);
        }
    }
}

/// A connection's place under the caps; dropping it frees the place.
pub(crate) struct ConnEntry {
    conns: Arc<Conns>,
    id: u64,
    close: Arc<Notify>,
}

impl ConnEntry {
    /// A request of this connection begins: it is no longer idle. False when the connection
    /// was already closed for a newcomer: then it must not serve the request.
    pub fn enter(&self) -> bool {
        self.conns.with(|t| t.enter(self.id))
    }

    /// A request of this connection ended.
    pub fn leave(&self) {
        self.conns.with(|t| t.leave(self.id, false));
    }

    /// No request of this connection is in flight (a lane between requests, or handing over
    /// to hyper, which counts its own).
    pub fn idle(&self) {
        self.conns.with(|t| t.leave(self.id, true));
    }

    /// Resolves once the connection is to be closed for a newcomer.
    pub fn evicted(&self) -> tokio::sync::futures::OwnedNotified {
        self.close.clone().notified_owned()
    }
}

impl Drop for ConnEntry {
    fn drop(&mut self) {
        self.conns.with(|t| t.remove(self.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn evicted(s: &ConnEntry) -> bool {
        // A stored permit makes `notified` ready at once.
        let mut f = std::pin::pin!(s.evicted());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        f.as_mut().poll(&mut cx).is_ready()
    }

    use std::future::Future as _;

    #[test]
    fn a_full_table_closes_the_longest_idle_then_refuses() {
        let c = Conns::new(Some(3), None, ConnCounters::default()).unwrap();
        let a = c.admit(ip(1)).unwrap();
        let b = c.admit(ip(2)).unwrap();
        let d = c.admit(ip(3)).unwrap();
        // `a` serves a request and becomes idle again: now `b` is the longest idle.
        assert!(a.enter());
        a.leave();
        let e = c.admit(ip(4)).unwrap();
        assert!(evicted(&b) && !evicted(&a) && !evicted(&d));
        assert!(!b.enter(), "an evicted connection serves no more requests");
        assert_eq!(c.open(), 3);
        for s in [&a, &d, &e] {
            assert!(s.enter());
        }
        assert_eq!(c.admit(ip(5)).err(), Some(Refused::Max));
        assert_eq!(c.open(), 3);
        drop(e);
        assert!(c.admit(ip(5)).is_ok());
        assert_eq!(c.counters.refused.get_or_create(&cap_label(MAX)).get(), 1);
        assert_eq!(c.counters.evicted.get_or_create(&cap_label(MAX)).get(), 1);
    }

    #[test]
    fn the_per_ip_cap_closes_only_that_ips_connections() {
        let c = Conns::new(None, Some(2), ConnCounters::default()).unwrap();
        let other = c.admit(ip(9)).unwrap();
        let a = c.admit(ip(1)).unwrap();
        let b = c.admit(ip(1)).unwrap();
        let d = c.admit(ip(1)).unwrap();
        assert!(evicted(&a) && !evicted(&b) && !evicted(&other));
        assert!(b.enter() && d.enter());
        assert_eq!(c.admit(ip(1)).err(), Some(Refused::PerIp));
        assert!(c.admit(ip(2)).is_ok());
    }

    #[test]
    fn a_connection_with_any_request_in_flight_is_busy() {
        let c = Conns::new(Some(1), None, ConnCounters::default()).unwrap();
        let a = c.admit(ip(1)).unwrap();
        assert!(a.enter() && a.enter());
        a.leave();
        assert_eq!(c.admit(ip(2)).err(), Some(Refused::Max));
        a.leave();
        assert!(c.admit(ip(2)).is_ok());
        assert!(evicted(&a));
    }
}
