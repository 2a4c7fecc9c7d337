//! The store calls behind a gateway's leases, off the request path: a lease and what its answer
//! does to the key, give-backs, a block's expiry, the sync that keeps this gateway's record in
//! the store alive, and the drain at shutdown.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::{Entry, LEASE_CALL_TIMEOUT, LeaseReply, Leases, RETRY_AFTER_FAILURE, SYNC_AFTER_US};
use crate::StoreError;
use tollgate_limit::bucket::BucketParams;
use tollgate_limit::lease::{Account, BLOCK_TTL_US, Grant, LeaseConfig, MAX_JITTER_US, block_cycle_us};
use tollgate_telemetry::metrics::Kind;

impl Leases {
    fn call_started(&self) {
        self.calls.fetch_add(1, Ordering::AcqRel);
    }

    fn call_done(&self) {
        if self.calls.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Notes a call about to be sent for the key, and makes sure a sync timer runs.
    pub(super) fn called(&self, fp: u64, e: &mut Entry, now: u64) {
        e.last_call = now;
        if !e.sync_armed {
            e.sync_armed = true;
            self.sync_at(fp, now + SYNC_AFTER_US);
        }
    }

    /// Gives `tokens` back for an entry, with what it spent since its last call.
    pub(super) fn give_from(&self, fp: u64, e: &mut Entry, tokens: u64, now: u64) {
        let spent = std::mem::take(&mut e.unspoken);
        self.called(fp, e, now);
        self.give_back_later(fp, e.key.clone(), e.params, tokens, spent);
    }

    /// A call failed, so the store may or may not have applied it: what it carried counts as
    /// spent, and the next call takes it off the record, which then errs low.
    fn call_failed(&self, fp: u64, carried: u64) {
        if let Some(e) = self.lock().keys.get_mut(&fp) {
            e.unspoken = e.unspoken.saturating_add(carried);
        }
    }

    /// Runs `then` on the key's entry, under the lock, once `at_us` has passed on this gateway's
    /// clock; nothing if the gateway or the key is gone by then.
    fn on_key_at(&self, fp: u64, at_us: u64, then: impl FnOnce(&Leases, &mut Entry, u64) + Send + 'static) {
        let weak = self.me.clone();
        let deadline = self.origin + Duration::from_micros(at_us);
        tokio::spawn(async move {
            tokio::time::sleep_until(deadline).await;
            let Some(me) = weak.upgrade() else { return };
            let now = me.now_us();
            let mut st = me.lock();
            if let Some(e) = st.keys.get_mut(&fp) {
                then(&me, e, now);
            }
        });
    }

    /// At `at_us`: if no call for the key went out for [`SYNC_AFTER_US`] and tokens were spent
    /// since the last one, a give-back of nothing reports them, before the store's record of
    /// this gateway expires and hands back what it has already spent.
    fn sync_at(&self, fp: u64, at_us: u64) {
        self.on_key_at(fp, at_us, move |me, e, now| {
            e.sync_armed = false;
            let due = e.last_call + SYNC_AFTER_US;
            if due > now {
                e.sync_armed = true;
                me.sync_at(fp, due);
            } else if e.unspoken > 0 {
                me.give_from(fp, e, 0, now);
            }
        });
    }

    /// Sends a lease for the key in the background, reporting `spent`; the answer goes to
    /// `answered`.
    pub(super) fn send_lease(&self, fp: u64, key: Arc<str>, cfg: LeaseConfig, spent: u64) {
        let Some(me) = self.me.upgrade() else { return };
        self.call_started();
        self.metrics
            .lease_calls
            .get_or_create(&Kind { kind: "lease" })
            .inc();
        tokio::spawn(async move {
            let cycle = block_cycle_us(&cfg.params, cfg.block, cfg.gateways);
            let acct = Account {
                holder: &me.holder,
                spent,
            };
            let answer = tokio::time::timeout(
                LEASE_CALL_TIMEOUT,
                me.lessor.lease(&key, &cfg.params, cfg.block, cycle, acct),
            )
            .await
            .unwrap_or(Err(StoreError::Timeout));
            if answer.is_err() {
                // Its block may have been granted and the answer lost.
                me.call_failed(fp, spent.saturating_add(cfg.block));
            }
            me.answered(fp, key, cfg.params, answer);
            me.call_done();
        });
    }

    /// What a lease's answer does to the key: a grant fills its holder (or goes straight back
    /// when draining), a denial holds it off until the store's time, a failure sends the key
    /// through the guard for [`RETRY_AFTER_FAILURE`].
    fn answered(&self, fp: u64, key: Arc<str>, p: BucketParams, answer: Result<LeaseReply, StoreError>) {
        let now = self.now_us();
        let mut st = self.lock();
        let closed = st.closed;
        let Some(e) = st.keys.get_mut(&fp) else {
            // Entries are never removed; still, granted tokens must not be lost.
            if let Ok(LeaseReply {
                grant: Grant::Granted { tokens },
                ..
            }) = answer
            {
                self.give_back_later(fp, key, p, tokens, 0);
            }
            return;
        };
        match answer {
            Ok(LeaseReply {
                grant: Grant::Granted { tokens },
                ..
            }) => {
                self.metrics.lease_grants.inc();
                self.metrics.lease_tokens_granted.inc_by(tokens);
                if closed {
                    e.holder.failed();
                    self.give_from(fp, e, tokens, now);
                } else {
                    e.holder.granted(now, tokens);
                    e.failing_until = 0;
                    self.metrics.lease_tokens_held.inc_by(tokens as i64);
                    self.expire_at(fp, now + BLOCK_TTL_US);
                }
            }
            Ok(LeaseReply {
                grant: Grant::Denied { until_us },
                now_us,
                ..
            }) => {
                self.metrics.lease_denials.inc();
                e.failing_until = 0;
                // The store's time and ours differ: carry over the wait, not the instant.
                let until = now.saturating_add(until_us.saturating_sub(now_us));
                e.holder.denied(until, rand::random_range(0..=MAX_JITTER_US));
            }
            Err(err) => {
                self.metrics
                    .lease_failures
                    .get_or_create(&Kind { kind: "lease" })
                    .inc();
                let retry = now + RETRY_AFTER_FAILURE.as_micros() as u64;
                e.failing_until = retry;
                e.holder.denied(retry, 0);
                if let Some(suppressed) = self.warn.allow(0) {
                    tracing::warn!(error = %err, suppressed, "lease call failed; leased limits are checked through the store guard for 1 s");
                }
            }
        }
        e.answered.send_modify(|n| *n += 1);
    }

    /// Expires the key's blocks once `at_us` has passed, and sends their rest back.
    fn expire_at(&self, fp: u64, at_us: u64) {
        self.on_key_at(fp, at_us, move |me, e, now| {
            let back = e.holder.expire(now);
            if back > 0 {
                me.metrics.lease_tokens_held.dec_by(back as i64);
                me.give_from(fp, e, back, now);
            }
        });
    }

    /// Gives `tokens` back to the store in the background, reporting `spent`.
    pub(super) fn give_back_later(&self, fp: u64, key: Arc<str>, p: BucketParams, tokens: u64, spent: u64) {
        let Some(me) = self.me.upgrade() else { return };
        self.call_started();
        self.metrics
            .lease_calls
            .get_or_create(&Kind { kind: "give_back" })
            .inc();
        tokio::spawn(async move {
            let acct = Account {
                holder: &me.holder,
                spent,
            };
            let r =
                tokio::time::timeout(LEASE_CALL_TIMEOUT, me.lessor.give_back(&key, &p, tokens, acct)).await;
            match r {
                Ok(Ok(_)) => {
                    me.metrics.lease_tokens_returned.inc_by(tokens);
                }
                Ok(Err(_)) | Err(_) => {
                    me.call_failed(fp, spent.saturating_add(tokens));
                    // Lost to this bucket until it refills: an undershoot, never an overshoot.
                    me.metrics
                        .lease_failures
                        .get_or_create(&Kind { kind: "give_back" })
                        .inc();
                }
            }
            me.call_done();
        });
    }

    /// Graceful shutdown: stops leasing, gives every held token back, and waits (at most
    /// `within`) for every lease and give-back call to finish, so grants still on their way
    /// go back too. Returns the tokens it gave back from the holders.
    pub async fn drain(&self, within: Duration) -> u64 {
        let deadline = Instant::now() + within;
        let mut given = 0;
        {
            let now = self.now_us();
            let mut st = self.lock();
            st.closed = true;
            for (&fp, e) in st.keys.iter_mut() {
                let t = e.holder.drain();
                if t > 0 {
                    given += t;
                    self.metrics.lease_tokens_held.dec_by(t as i64);
                }
                // Spent tokens are reported too, so a clean exit leaves no record to reclaim.
                if t > 0 || e.unspoken > 0 {
                    self.give_from(fp, e, t, now);
                }
            }
        }
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            let left = self.calls.load(Ordering::Acquire);
            if left == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                tracing::warn!(
                    calls = left,
                    "shutdown: lease calls still unanswered; their tokens come back as the bucket refills"
                );
                break;
            }
        }
        given
    }
}
