//! Exact token-bucket arithmetic: integer microseconds, integer token units, time passed in.
//!
//! A limit of `N` tokens per `P` seconds refills `N / P` tokens a second. We count
//! tokens in *units* of `1 / scale` token, where `scale = P_µs / gcd(N, P_µs)`, so one
//! microsecond adds exactly `refill = N / gcd(N, P_µs)` units. Every refill is then an
//! integer and no decision ever depends on float rounding. A retry storm of one request every
//! 2.5 ms puts arrivals exactly on token boundaries (a bucket holding exactly one token at
//! 09:00:00.100), which is where a float bucket would disagree.
//!
//! `lua/check.lua` runs the same arithmetic inside Redis. Lua 5.1 numbers are doubles,
//! exact for integers below 2^53, so every value here is kept below [`MAX_EXACT`] and
//! rule validation refuses numbers that would not fit.

use std::fmt;

/// Integers below this are exact in a Lua (double) number.
pub const MAX_EXACT: u64 = 1 << 53;

/// Microseconds in a second.
pub const US_PER_S: u64 = 1_000_000;

/// `tokens` per `period_us` microseconds: the contract's rate as written (`600/60s`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    pub tokens: u64,
    pub period_us: u64,
}

impl Rate {
    /// Parses `N/Ps`, `N/Pms`, `N/Pm`, `N/Ph` or `N/s` (a period of one unit).
    ///
    /// ```
    /// use tollgate_limit::bucket::Rate;
    ///
    /// let r = Rate::parse("600/60s").unwrap();
    /// assert_eq!((r.tokens, r.period_us), (600, 60_000_000));
    /// assert_eq!(r.per_second(), 10.0);
    /// assert_eq!(Rate::parse("5/s").unwrap().period_us, 1_000_000);
    ///
    /// // A unit it does not know is named in the error.
    /// let e = Rate::parse("10/1d").unwrap_err();
    /// assert!(e.contains("unknown unit \"d\""), "{e}");
    /// ```
    pub fn parse(text: &str) -> Result<Rate, String> {
        let (n, p) = text
            .split_once('/')
            .ok_or_else(|| format!("rate {text:?} must look like \"10/1s\" or \"600/60s\""))?;
        let tokens: u64 = n
            .trim()
            .parse()
            .map_err(|_| format!("rate {text:?}: {n:?} is not a whole number of tokens"))?;
        let p = p.trim();
        let split = p
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| format!("rate {text:?}: the period {p:?} needs a unit (us, ms, s, m, h)"))?;
        let (count, unit) = p.split_at(split);
        let count: u64 = if count.is_empty() {
            1
        } else {
            count
                .parse()
                .map_err(|_| format!("rate {text:?}: {count:?} is not a whole number"))?
        };
        let unit_us = match unit {
            "us" | "µs" => 1,
            "ms" => 1_000,
            "s" => US_PER_S,
            "m" | "min" => 60 * US_PER_S,
            "h" => 3_600 * US_PER_S,
            _ => {
                return Err(format!(
                    "rate {text:?}: unknown unit {unit:?} (use us, ms, s, m or h)"
                ));
            }
        };
        let period_us = count
            .checked_mul(unit_us)
            .ok_or_else(|| format!("rate {text:?}: the period is too long"))?;
        if tokens == 0 {
            return Err(format!("rate {text:?}: the rate must be above zero"));
        }
        if period_us == 0 {
            return Err(format!("rate {text:?}: the period must be above zero"));
        }
        Ok(Rate { tokens, period_us })
    }

    /// Tokens per second, for display only.
    pub fn per_second(&self) -> f64 {
        self.tokens as f64 * US_PER_S as f64 / self.period_us as f64
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self.period_us;
        if p.is_multiple_of(US_PER_S) {
            write!(f, "{}/{}s", self.tokens, p / US_PER_S)
        } else if p.is_multiple_of(1_000) {
            write!(f, "{}/{}ms", self.tokens, p / 1_000)
        } else {
            write!(f, "{}/{}us", self.tokens, p)
        }
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The compiled numbers of one bucket. Copy-cheap; travels to the store with every check.
///
/// A rate of 2 tokens a second counts in half tokens, so each microsecond's refill is whole:
///
/// ```
/// use tollgate_limit::bucket::{BucketParams, ParamError, Rate};
///
/// let p = BucketParams::new(Rate::parse("2/1s").unwrap(), 3).unwrap();
/// assert_eq!((p.scale, p.refill), (500_000, 1));
/// assert_eq!(p.capacity, 3 * p.scale);
/// assert_eq!(p.units(2), 2 * p.scale);
/// // Empty to full: 3 tokens at 2 a second.
/// assert_eq!(p.fill_time_us(), 1_500_000);
///
/// let zero = BucketParams::new(Rate::parse("2/1s").unwrap(), 0);
/// assert_eq!(zero, Err(ParamError::ZeroBurst));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketParams {
    /// Units per whole token.
    pub scale: u64,
    /// Units added per microsecond.
    pub refill: u64,
    /// `burst × scale`: the most units the bucket holds.
    pub capacity: u64,
    /// The burst in whole tokens.
    pub burst: u64,
    /// The rate as configured, for headers and display.
    pub rate: Rate,
    /// Units a post-paid limit's bucket may owe (`max_debt × scale`), or a queueing limit's
    /// (`max_wait_us × refill`); 0 for every other limit, whose buckets never go below empty.
    pub debt: u64,
    /// For a limit that queues rather than refuses (`"delay"`): the longest a request may wait
    /// for its tokens, in microseconds. 0: a request short of tokens is refused.
    pub max_wait_us: u64,
    /// For a limit that blocks (`"block_for"`): how long a bucket that refused a request refuses
    /// every request after it, whatever refills meanwhile, in microseconds. 0: no block.
    pub block_us: u64,
}

/// Why a rate and burst can't be compiled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamError {
    #[error("the burst must be at least 1")]
    ZeroBurst,
    #[error("the rate must be above zero")]
    ZeroRate,
    #[error(
        "burst {burst} at rate {rate} needs {units} internal units, above the exact limit 2^53; use a shorter period or a smaller burst"
    )]
    TooLarge { burst: u64, rate: Rate, units: u128 },
    #[error(
        "rate {rate} needs {scale} units per token, above 2^32; use a period of at most about 71 minutes, or more tokens per period"
    )]
    ScaleTooLarge { rate: Rate, scale: u64 },
    #[error(
        "a debt of {max_debt} tokens with this burst needs {units} internal units, above the exact limit 2^53; use a smaller max_debt"
    )]
    DebtTooLarge { max_debt: u64, units: u128 },
    #[error(
        "a wait of {max_wait_us} µs at this rate is {units} internal units owed, above the exact limit 2^53; use a shorter max_wait_ms"
    )]
    WaitTooLong { max_wait_us: u64, units: u128 },
}

impl BucketParams {
    pub fn new(rate: Rate, burst: u64) -> Result<BucketParams, ParamError> {
        if burst == 0 {
            return Err(ParamError::ZeroBurst);
        }
        if rate.tokens == 0 || rate.period_us == 0 {
            return Err(ParamError::ZeroRate);
        }
        let g = gcd(rate.tokens, rate.period_us);
        let scale = rate.period_us / g;
        let refill = rate.tokens / g;
        if scale > u32::MAX as u64 {
            return Err(ParamError::ScaleTooLarge { rate, scale });
        }
        let units = burst as u128 * scale as u128;
        // Headroom: tokens + one microsecond of refill must stay exact too.
        if units + refill as u128 >= MAX_EXACT as u128 {
            return Err(ParamError::TooLarge { burst, rate, units });
        }
        Ok(BucketParams {
            scale,
            refill,
            capacity: units as u64,
            burst,
            rate,
            debt: 0,
            max_wait_us: 0,
            block_us: 0,
        })
    }

    /// These numbers for a post-paid limit whose bucket may owe up to `max_debt` tokens: what
    /// the upstream reports after the answer is charged even when the bucket can't pay it, and
    /// refill pays the debt before the bucket admits again.
    pub fn with_debt(self, max_debt: u64) -> Result<BucketParams, ParamError> {
        self.owing(max_debt as u128 * self.scale as u128)
            .map_err(|units| ParamError::DebtTooLarge { max_debt, units })
    }

    /// These numbers for a limit that queues: a request short of tokens is admitted when they
    /// are due within `max_wait_us`, and waits for them; its bucket owes them meanwhile, up to
    /// `max_wait_us` of refill (the rate × the wait), so gateways sharing it queue as one.
    pub fn with_delay(self, max_wait_us: u64) -> Result<BucketParams, ParamError> {
        let mut p = self
            .owing(max_wait_us as u128 * self.refill as u128)
            .map_err(|units| ParamError::WaitTooLong { max_wait_us, units })?;
        p.max_wait_us = max_wait_us;
        Ok(p)
    }

    /// These numbers owing up to `debt` units, when every balance between `-debt` and the
    /// capacity, and one microsecond's refill more, stays exact; else the units that would not.
    fn owing(mut self, debt: u128) -> Result<BucketParams, u128> {
        let total = self.capacity as u128 + debt + self.refill as u128;
        if total >= MAX_EXACT as u128 {
            return Err(total);
        }
        self.debt = debt as u64;
        Ok(self)
    }

    /// Whether a bucket whose wait for a request is `wait` pays for it now: at once, or for a
    /// queueing limit within its longest wait.
    #[inline]
    pub fn pays(&self, wait: Option<u64>) -> bool {
        matches!(wait, Some(w) if w <= self.max_wait_us)
    }

    /// Microseconds an empty bucket takes to fill: `b / r`, rounded up.
    pub fn fill_time_us(&self) -> u64 {
        self.capacity.div_ceil(self.refill)
    }

    /// Key expiry in milliseconds: at least `b / r`, so expiry never hands out free tokens
    /// (an idle bucket is full by then, and a missing one starts full), plus one second of slack
    /// for clock granularity.
    pub fn ttl_ms(&self) -> u64 {
        self.fill_time_us().div_ceil(1_000) + 1_000
    }

    /// Units a request of `cost` tokens needs.
    pub fn units(&self, cost: u64) -> u64 {
        cost.saturating_mul(self.scale)
    }
}

/// What a bucket holds: `tokens` units of `1 / scale` token, as computed at `ts` microseconds.
///
/// The scale is stored with the tokens because it depends on the rule's rate: when a rule
/// changes, the stored units are converted to the new scale before the refill, so a bucket
/// keeps its tokens across rule versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BucketState {
    pub tokens: u64,
    pub ts: u64,
    pub scale: u64,
}

/// Converts units from one scale to another: exact for whole tokens, and the fraction rounded
/// down through one IEEE double division and multiplication, exactly as `lua/check.lua` does.
#[inline]
pub fn rescale(tokens: u64, from: u64, to: u64) -> u64 {
    if from == to || from == 0 {
        return tokens;
    }
    let frac = tokens % from;
    let whole = tokens / from;
    whole
        .saturating_mul(to)
        .saturating_add(((frac as f64 / from as f64) * to as f64).floor() as u64)
}

/// Units in the bucket at `now`: lazy refill, elapsed time clamped at zero (a clock that went
/// back gives no refill), and never above the capacity given now (a tightened rule clamps
/// stored tokens; it never resets them to full). A missing bucket starts full.
#[inline]
pub fn refill(p: &BucketParams, state: Option<BucketState>, now: u64) -> u64 {
    let Some(s) = state else {
        return p.capacity;
    };
    let tokens = rescale(s.tokens, s.scale, p.scale);
    if tokens >= p.capacity {
        return p.capacity;
    }
    let elapsed = now.saturating_sub(s.ts);
    let room = p.capacity - tokens;
    // Compare in time first so the multiplication can't overflow after a long idle.
    if elapsed >= room.div_ceil(p.refill) {
        p.capacity
    } else {
        tokens + elapsed * p.refill
    }
}

/// Microseconds of refill a post-paid bucket still owes at `now`: a bucket in debt is stored
/// empty with its time in the future, the moment refill has paid the debt back, so the encoding
/// (and an old gateway reading it) stays that of any bucket. Always 0 for a limit that can't
/// owe: for those an empty bucket stamped ahead of `now` only means a writer's clock ran ahead,
/// which gives no refill and no debt.
#[inline]
pub fn owed_us(p: &BucketParams, state: Option<BucketState>, now: u64) -> u64 {
    match state {
        Some(s) if p.debt > 0 && s.tokens == 0 => s.ts.saturating_sub(now),
        _ => 0,
    }
}

/// Microseconds until `tokens` units become `need` units. `None` when no wait helps
/// (the request costs more than the burst).
#[inline]
pub fn wait_us(p: &BucketParams, tokens: u64, need: u64) -> Option<u64> {
    wait_owing_us(p, tokens, 0, need)
}

/// [`wait_us`] for a bucket that first owes `owed` microseconds of refill (then `tokens` is 0).
#[inline]
pub fn wait_owing_us(p: &BucketParams, tokens: u64, owed: u64, need: u64) -> Option<u64> {
    if need > p.capacity {
        None
    } else if need == 0 || (owed == 0 && tokens >= need) {
        Some(0)
    } else {
        Some(owed + (need - tokens).div_ceil(p.refill))
    }
}

/// What a bucket holds at `now` as a signed number of units: below zero while it owes, never
/// below `-debt`.
#[inline]
pub fn balance(p: &BucketParams, state: Option<BucketState>, now: u64) -> i64 {
    let owed = owed_us(p, state, now);
    if owed == 0 {
        return refill(p, state, now) as i64;
    }
    // Compare in time first so the product can't overflow after a long clock skew.
    if owed >= p.debt.div_ceil(p.refill) {
        -(p.debt as i64)
    } else {
        -((owed * p.refill).min(p.debt) as i64)
    }
}

/// The state that holds `balance` units at `now`: itself when not below zero, else empty until
/// refill has paid the debt, rounded up to a whole microsecond.
#[inline]
pub fn at_balance(p: &BucketParams, balance: i64, now: u64) -> BucketState {
    if balance >= 0 {
        BucketState {
            tokens: balance as u64,
            ts: now,
            scale: p.scale,
        }
    } else {
        BucketState {
            tokens: 0,
            ts: now + balance.unsigned_abs().div_ceil(p.refill),
            scale: p.scale,
        }
    }
}

/// The bucket at `now` with `units` added (a refund) or taken (a post-paid debit, when
/// negative), kept between `-debt` and its capacity. Returns the new state and its balance.
///
/// A queueing limit's bucket that owes gets nothing back: its debt is the turns of the requests
/// still waiting, the last of them at the debt's end, and any credit would hand the next
/// newcomer a turn on top of one already given, sending more than the limit upstream. The
/// turn of a request that left the queue passes unused, as nginx's `limit_req` keeps a
/// delayed request's excess; once the queue has drained, refunds count again.
#[inline]
pub fn adjust(p: &BucketParams, state: Option<BucketState>, units: i64, now: u64) -> (BucketState, i64) {
    let held = balance(p, state, now);
    let units = if units > 0 && p.max_wait_us > 0 && held < 0 {
        0
    } else {
        units
    };
    let b = held
        .saturating_add(units)
        .clamp(-(p.debt as i64), p.capacity as i64);
    (at_balance(p, b, now), b)
}

/// Whole seconds for `Retry-After`: the wait rounded up, at least 1 for a limited request.
#[inline]
pub fn retry_after_secs(wait_us: u64) -> u64 {
    wait_us.div_ceil(US_PER_S).max(1)
}

/// One bucket's part of a check: its numbers, what the request costs in it, and whether it is
/// only observed (shadow) or enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Charge {
    pub params: BucketParams,
    pub cost: u64,
    pub shadow: bool,
}

/// One bucket's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketVerdict {
    /// Whether this bucket held enough for its cost.
    pub sufficient: bool,
    /// Units left after the check (after charging, if the check charged it).
    pub tokens: u64,
    /// Microseconds until this bucket could pay its cost: 0 when it pays at once, `None` if
    /// never. A queueing limit's bucket that is sufficient with a wait above 0 admitted the
    /// request to wait that long. A blocked bucket's wait is until its block ends.
    pub wait_us: Option<u64>,
    /// The bucket is blocked (a `block_for` limit refused it earlier): it refused this request
    /// whatever it holds.
    pub blocked: bool,
}

impl BucketVerdict {
    /// Whole tokens left.
    pub fn remaining(&self, p: &BucketParams) -> u64 {
        self.tokens / p.scale
    }
}

/// Checks every bucket of one request at `now`, all or nothing.
///
/// Enforced buckets are charged together only if every one of them holds its cost; otherwise
/// none is charged. A shadow bucket is charged on its own when it holds its cost, and its
/// shortage never blocks the request. Every state is written back, refilled to `now`, whether
/// the request was admitted or not. Returns whether the request is admitted.
///
/// A bucket of burst 3 at one token a second admits three requests at once, refuses the
/// fourth with the wait for one token, and admits again once that wait has passed:
///
/// ```
/// use tollgate_limit::bucket::{
///     BucketParams, BucketVerdict, Charge, Rate, check_all, retry_after_secs,
/// };
///
/// let params = BucketParams::new(Rate::parse("1/1s").unwrap(), 3).unwrap();
/// let charges = [Charge { params, cost: 1, shadow: false }];
/// let mut states = [None]; // never written: the bucket starts full
/// let mut out = [BucketVerdict { sufficient: false, tokens: 0, wait_us: None, blocked: false }];
///
/// for left in [2, 1, 0] {
///     assert!(check_all(&charges, &mut states, 0, &mut out));
///     assert_eq!(out[0].remaining(&params), left);
/// }
/// assert!(!check_all(&charges, &mut states, 0, &mut out));
/// assert_eq!(out[0].wait_us, Some(1_000_000));
/// assert_eq!(retry_after_secs(out[0].wait_us.unwrap()), 1);
///
/// assert!(check_all(&charges, &mut states, 1_000_000, &mut out));
/// ```
pub fn check_all(
    charges: &[Charge],
    states: &mut [Option<BucketState>],
    now: u64,
    out: &mut [BucketVerdict],
) -> bool {
    check_blocking(charges, states, &mut [], now, out)
}

/// [`check_all`] with blocks: `blocks[i]`, when the bucket of `charges[i]` has a block, is the
/// microsecond it ends (empty: no bucket has one). A bucket blocked at `now` refuses a request
/// that would charge it, whatever it holds (a shadow one only counts it); a bucket of a limit with
/// `block_us` that refuses a request, not blocked already, starts a block until `now +
/// block_us`, written back into `blocks`.
pub fn check_blocking(
    charges: &[Charge],
    states: &mut [Option<BucketState>],
    blocks: &mut [Option<u64>],
    now: u64,
    out: &mut [BucketVerdict],
) -> bool {
    debug_assert_eq!(charges.len(), states.len());
    debug_assert_eq!(charges.len(), out.len());
    debug_assert!(blocks.is_empty() || blocks.len() == charges.len());
    let mut admitted = true;
    for (i, ((c, s), v)) in charges.iter().zip(states.iter()).zip(out.iter_mut()).enumerate() {
        let tokens = refill(&c.params, *s, now);
        let need = c.params.units(c.cost);
        // A check of cost 0 (the usage route reading a key's buckets) charges nothing, so no
        // block refuses it.
        let until = blocks
            .get(i)
            .copied()
            .flatten()
            .filter(|&u| u > now && c.params.block_us > 0 && need > 0);
        let (wait, blocked) = match until {
            Some(u) => (Some(u - now), true),
            None => (
                wait_owing_us(&c.params, tokens, owed_us(&c.params, *s, now), need),
                false,
            ),
        };
        let sufficient = !blocked && c.params.pays(wait);
        if !sufficient && !c.shadow {
            admitted = false;
        }
        *v = BucketVerdict {
            sufficient,
            tokens,
            wait_us: wait,
            blocked,
        };
    }
    if !blocks.is_empty() {
        for (i, (c, v)) in charges.iter().zip(out.iter()).enumerate() {
            if c.params.block_us > 0 && !v.sufficient && !v.blocked {
                blocks[i] = Some(now + c.params.block_us);
            }
        }
    }
    for ((c, s), v) in charges.iter().zip(states.iter_mut()).zip(out.iter_mut()) {
        let charge = v.sufficient && (admitted || c.shadow);
        let mut ts = now + owed_us(&c.params, *s, now);
        match v.wait_us {
            // A queued request owes its tokens until they are due: the bucket is empty until
            // then, as a post-paid debt is.
            Some(w) if charge && w > 0 => {
                v.tokens = 0;
                ts = now + w;
            }
            _ if charge => v.tokens -= c.params.units(c.cost),
            // A debt stays where it is: the bucket is empty until its time comes.
            _ => {}
        }
        *s = Some(BucketState {
            tokens: v.tokens,
            ts,
            scale: c.params.scale,
        });
    }
    admitted
}

/// Whether [`check_all`] took `c`'s cost from its bucket: an enforced bucket only when the
/// request was admitted, a shadow bucket whenever it held its cost.
#[inline]
pub fn charged(c: &Charge, v: &BucketVerdict, admitted: bool) -> bool {
    v.sufficient && (admitted || c.shadow)
}

/// The bucket refilled to `now` with `units` added, never above its capacity: what a lease's
/// give-back and a check's refund write. A debt is paid from them first.
#[inline]
pub fn give_back(p: &BucketParams, state: Option<BucketState>, units: u64, now: u64) -> BucketState {
    adjust(p, state, units.min(i64::MAX as u64) as i64, now).0
}

/// Undoes what [`check_all`] charged for an admitted request that was then not delivered: every
/// bucket it charged, the shadow ones included (the request never happened, so a shadow limit
/// must not count it either), gets its cost back at `now`, capped at its capacity. Buckets it
/// did not charge keep their state untouched; a limited request's refund changes nothing (its
/// shadow charges stand, as the request was answered).
///
/// Refunding at the check's `now` restores every bucket exactly; later, each holds what it would
/// hold had the request never been checked, since refill is linear up to the capacity.
pub fn refund_all(
    charges: &[Charge],
    verdicts: &[BucketVerdict],
    admitted: bool,
    states: &mut [Option<BucketState>],
    now: u64,
) {
    debug_assert_eq!(charges.len(), states.len());
    debug_assert_eq!(charges.len(), verdicts.len());
    if !admitted {
        return;
    }
    for ((c, v), s) in charges.iter().zip(verdicts).zip(states.iter_mut()) {
        if charged(c, v, admitted) {
            *s = Some(give_back(&c.params, *s, c.params.units(c.cost), now));
        }
    }
}

/// Seconds until a bucket holding `tokens` units is full again.
pub fn secs_to_full(p: &BucketParams, tokens: u64) -> u64 {
    p.capacity
        .saturating_sub(tokens)
        .div_ceil(p.refill)
        .div_ceil(US_PER_S)
}

/// [`secs_to_full`] of a signed balance: a debt takes its repayment first.
pub fn secs_to_full_from(p: &BucketParams, balance: i64) -> u64 {
    let short = (p.capacity as i128 - balance as i128).max(0) as u64;
    short.div_ceil(p.refill).div_ceil(US_PER_S)
}

#[cfg(test)]
mod tests;
