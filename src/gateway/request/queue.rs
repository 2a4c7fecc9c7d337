//! A queued request's wait: a limit with `"delay"` admits a request short of tokens to wait
//! until they are due. The wait comes after the check (which charged the tokens ahead) and
//! before the upstream's place is taken, so a waiting request holds none; a client that hangs
//! up meanwhile gets its tokens back.

use std::time::Duration;

use super::Gateway;
use crate::request::drive::Wire;
use crate::request::{Begun, Forward, InFlight, Paid};

/// The longest a waiting request sleeps before it reads the gateway's clock again, so a clock
/// moved by hand (a test's) is followed within this.
const STEP: Duration = Duration::from_millis(20);

/// What a waiting request paid, given back if it is dropped before its turn: hyper drops the
/// request of a client that went away, so nothing after the wait would run.
struct Owed<'a> {
    gw: &'a Gateway,
    paid: Option<Box<Paid>>,
}

impl Owed<'_> {
    fn keep(mut self) -> Option<Box<Paid>> {
        self.paid.take()
    }
}

impl Drop for Owed<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.paid.take() {
            let (store, metrics) = (self.gw.store.clone(), self.gw.metrics.clone());
            tokio::spawn(async move {
                super::forward::refund(&*store, &p).await;
                metrics.queue_left.inc();
            });
        }
    }
}

impl Gateway {
    /// Resolves once `delay_us` have passed on the gateway's clock.
    pub(super) async fn turn(&self, delay_us: u64) {
        let until = self.clock.now_us().saturating_add(delay_us);
        loop {
            let now = self.clock.now_us();
            if now >= until {
                return;
            }
            tokio::time::sleep(Duration::from_micros(until - now).min(STEP)).await;
        }
    }

    /// Waits out an admitted request's `delay`, then takes its place under the upstream's limit.
    /// A client that hangs up meanwhile, or an upstream with no place left after the wait,
    /// gets the request's charge back.
    pub(super) async fn wait_turn<W: Wire>(
        &self,
        b: &mut Begun<'_>,
        f: &mut Forward,
        wire: &mut W,
    ) -> Result<(), super::drive::Stop> {
        let delay_us = std::mem::take(&mut f.delay_us);
        self.metrics.queued.inc();
        let _waiting = InFlight::new(&self.metrics.queue_waiting);
        let owed = Owed {
            gw: self,
            paid: f.paid.take(),
        };
        let here = wire.wait(self.turn(delay_us)).await;
        f.paid = owed.keep();
        if !here {
            self.give_back(&mut b.facts, f.paid.take()).await;
            self.metrics.queue_left.inc();
            return Err(super::drive::Stop::Gone);
        }
        let (snap, live) = (&*b.snap, &*b.live);
        match self
            .gate(
                &snap.upstreams[f.upstream],
                &live.upstreams[f.upstream],
                &mut b.facts,
            )
            .await
        {
            Ok(place) => {
                f.place = Some(place);
                b.facts.metered = f.classified.key.map(|(k, _)| k);
                Ok(())
            }
            Err(a) => {
                self.give_back(&mut b.facts, f.paid.take()).await;
                Err(a.into())
            }
        }
    }
}
