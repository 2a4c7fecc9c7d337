//! Changes to buckets after their check, one `lua/refund.lua` call each: the refund of an
//! undelivered request and a post-paid route's debit.

use fred::prelude::{Key, Value};
use smallvec::SmallVec;

use super::{RedisStore, as_i64, int, store_error};
use crate::page::page_of;
use crate::{Adjusted, CheckItem, Outcome, StoreError, mismatch};

impl RedisStore {
    /// Gives back what the check that answered `outcome` charged `batch`, in one call of
    /// `lua/refund.lua`; see [`Store::refund`](crate::Store::refund). `None` when it charged
    /// nothing (a limited request), and then no call is made.
    pub async fn refund_batch(
        &self,
        batch: &[CheckItem],
        outcome: &Outcome,
    ) -> Result<Option<Adjusted>, StoreError> {
        if batch.len() != outcome.buckets.len() {
            return Err(mismatch(batch, outcome));
        }
        let units = crate::refund_units(batch, outcome);
        if units.iter().all(|u| *u == 0) {
            return Ok(None);
        }
        self.adjust_batch(batch, &units).await.map(Some)
    }

    /// Adds `units[i]` to the bucket of `batch[i]` in one call of `lua/refund.lua` (none when
    /// every amount is 0); see [`Store::adjust`](crate::Store::adjust).
    pub async fn adjust_batch(&self, batch: &[CheckItem], units: &[i64]) -> Result<Adjusted, StoreError> {
        let n = units.iter().filter(|u| **u != 0).count();
        if n == 0 {
            return Ok(Adjusted::none(batch.len()));
        }
        let reply = self
            .shared
            .eval_script(&self.shared.refund_sha, || {
                let mut keys = Vec::with_capacity(2 * n);
                let mut pages = Vec::with_capacity(n);
                let mut args = Vec::with_capacity(1 + 7 * n);
                args.push(Value::Integer(self.shared.clock_arg()));
                for (item, &u) in batch.iter().zip(units).filter(|(_, u)| **u != 0) {
                    let p = &item.charge.params;
                    keys.push(Key::from(&*item.key));
                    pages.push(Key::from(page_of(&item.key)));
                    args.extend(
                        [
                            as_i64(p.scale),
                            as_i64(p.refill),
                            as_i64(p.capacity),
                            u,
                            as_i64(p.ttl_ms()),
                            as_i64(p.debt),
                            i64::from(p.max_wait_us > 0),
                        ]
                        .map(Value::Integer),
                    );
                }
                keys.extend(pages);
                (keys, args)
            })
            .await
            .map_err(|e| store_error(&e))?;
        let bad = |what: String| StoreError::Protocol(format!("lua/refund.lua answered {what}"));
        let Value::Array(items) = reply else {
            return Err(bad(format!("{reply:?}, not an array")));
        };
        if items.len() != 1 + n {
            return Err(bad(format!("{} values, not {}", items.len(), 1 + n)));
        }
        let mut nums = items
            .iter()
            .map(|v| int(v).ok_or_else(|| bad(format!("{v:?}, not an integer"))));
        let now_us = nums
            .next()
            .unwrap_or_else(|| Err(bad("nothing".into())))
            .and_then(|x| u64::try_from(x).map_err(|_| bad(format!("the time {x}"))))?;
        let mut balances = SmallVec::with_capacity(batch.len());
        for &u in units {
            balances.push(if u != 0 { nums.next().transpose()? } else { None });
        }
        Ok(Adjusted { now_us, balances })
    }

    /// The refund script's SHA-1.
    pub fn refund_script_sha(&self) -> &str {
        &self.shared.refund_sha
    }
}
