//! A check's way to the store: each request's buckets in the script's terms (`Pending`), the
//! queue whose checks share the next call, the KEYS and ARGV of one `lua/check.lua` call, and
//! the reading of its reply.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use fred::prelude::{Key, Value};
use fred::util::redis_keyslot;
use smallvec::SmallVec;
use tokio::sync::{mpsc, oneshot};

use super::{RedisStore, Shared, as_i64, int, store_error};
use crate::page::page_of;
use crate::{CheckItem, Outcome, Source, StoreError};
use tollgate_limit::bucket::BucketVerdict;

/// A bucket's rule as kept here: scale, refill, capacity, need, ttl, flags, debt, block. Sent in
/// full it is the first 7, and the block only for a bucket with the [`BLOCK`] flag.
const ARGS_PER_BUCKET: usize = 8;
/// Where the need and the flags are among a bucket's [`ARGS_PER_BUCKET`].
const NEED: usize = 3;
const FLAGS: usize = 5;
/// The flag that tells the script the call names the bucket again (1 is shadow).
const KEEP: i64 = 2;
/// The flag of a queueing limit's bucket: its debt is its longest wait's worth of refill.
const DELAY: i64 = 4;
/// The flag of a blocking limit's bucket (`block_for`).
const BLOCK: i64 = 8;

/// The most requests and buckets in one call: a script blocks its node while it runs, so one
/// call stays short (about 3 µs of script per bucket).
const MAX_REQUESTS_PER_CALL: usize = 64;
const MAX_KEYS_PER_CALL: usize = 256;

/// One request's check, waiting in the queue: its buckets already in the script's terms.
pub(super) struct Pending {
    keys: SmallVec<[Key; 4]>,
    /// The page of each bucket in `keys` (`page::page_of`), in the same order.
    pages: SmallVec<[Key; 4]>,
    /// [`ARGS_PER_BUCKET`] per bucket.
    args: SmallVec<[i64; 32]>,
    /// Each bucket's longest wait (`BucketParams::max_wait_us`), to read the reply by.
    waits: SmallVec<[u64; 4]>,
    /// The hash slot of its keys in a cluster: only requests of one slot share a call.
    slot: Option<u16>,
    reply: oneshot::Sender<Result<Outcome, StoreError>>,
}

impl Pending {
    fn new(batch: &[CheckItem], cluster: bool) -> (Pending, oneshot::Receiver<Result<Outcome, StoreError>>) {
        let (reply, rx) = oneshot::channel();
        let keys: SmallVec<[Key; 4]> = batch.iter().map(|i| Key::from(&*i.key)).collect();
        let pages: SmallVec<[Key; 4]> = batch.iter().map(|i| Key::from(page_of(&i.key))).collect();
        let mut args = SmallVec::new();
        for i in batch {
            let p = &i.charge.params;
            // Any need above the capacity answers the same ("never"), so cap it there and keep
            // every ARGV exact in a double.
            let need = p.units(i.charge.cost).min(p.capacity + 1);
            args.extend([
                as_i64(p.scale),
                as_i64(p.refill),
                as_i64(p.capacity),
                as_i64(need),
                as_i64(p.ttl_ms()),
                i64::from(i.charge.shadow)
                    | if p.max_wait_us > 0 { DELAY } else { 0 }
                    | if p.block_us > 0 { BLOCK } else { 0 },
                as_i64(p.debt),
                as_i64(p.block_us),
            ]);
        }
        let waits = batch.iter().map(|i| i.charge.params.max_wait_us).collect();
        let slot = cluster.then(|| redis_keyslot(keys.first().map(|k| k.as_bytes()).unwrap_or(b"")));
        (
            Pending {
                keys,
                pages,
                args,
                waits,
                slot,
                reply,
            },
            rx,
        )
    }
}

impl RedisStore {
    /// Checks one batch in the store.
    pub async fn check_batch(&self, batch: &[CheckItem]) -> Result<Outcome, StoreError> {
        if batch.is_empty() {
            let now_us = self.now_us().await?;
            return Ok(Outcome {
                admitted: true,
                now_us,
                buckets: SmallVec::new(),
                source: Source::Store,
                leased: 0,
            });
        }
        let (pending, rx) = Pending::new(batch, self.shared.cluster);
        // On one node, through the queue even when a call slot is free: sent from here, each
        // request of a burst took a call of its own while slots lasted (4.3 checks a call in
        // row R against 8.1 through the queue, and redis-server's CPU per request 16% higher).
        // On a cluster checks of one slot rarely meet, so a free slot sends at once.
        if self.shared.cluster
            && let Ok(permit) = self.shared.permits.clone().try_acquire_owned()
        {
            self.shared.call(vec![pending]).await;
            drop(permit);
        } else if self.queue.send(pending).is_err() {
            return Err(StoreError::Unavailable(
                "the Redis store's queue has stopped".into(),
            ));
        }
        rx.await.unwrap_or_else(|_| {
            Err(StoreError::Unavailable(
                "the Redis store's queue has stopped".into(),
            ))
        })
    }

    /// Checks several requests in one script call, in order, at one `now`: what the queue does
    /// when the store falls behind. All batches must share a hash slot in a cluster.
    pub async fn check_together(
        &self,
        batches: &[&[CheckItem]],
    ) -> Result<Vec<Result<Outcome, StoreError>>, StoreError> {
        let mut receivers = Vec::with_capacity(batches.len());
        let mut pending = Vec::with_capacity(batches.len());
        for b in batches {
            let (p, rx) = Pending::new(b, self.shared.cluster);
            pending.push(p);
            receivers.push(rx);
        }
        self.shared.call(pending).await;
        let mut out = Vec::with_capacity(receivers.len());
        for rx in receivers {
            out.push(
                rx.await
                    .map_err(|_| StoreError::Unavailable("no answer".into()))?,
            );
        }
        Ok(out)
    }
}

impl Shared {
    /// One script call for `requests`; every request gets its answer on its own channel.
    async fn call(&self, requests: Vec<Pending>) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.checks.fetch_add(requests.len() as u64, Ordering::Relaxed);
        let build = || encode_call(self.clock_arg(), &requests);
        let reply = self.eval(build).await;
        let parsed = {
            let sizes: SmallVec<[&[u64]; 16]> = requests.iter().map(|r| &r.waits[..]).collect();
            reply
                .map_err(|e| store_error(&e))
                .and_then(|v| parse_reply(&sizes, v))
        };
        match parsed {
            Ok(outcomes) => {
                for (r, o) in requests.into_iter().zip(outcomes) {
                    let _ = r.reply.send(o);
                }
            }
            Err(e) => {
                for r in requests {
                    let _ = r.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// How many earlier buckets of a call a bucket is compared with to find its repeat. The
/// requests that share a call are mostly one client's burst, whose buckets are among the first
/// few; a bucket past these is sent as new, which the script reads and writes correctly, only
/// at the cost of its rule's arguments.
const REPEAT_SCAN: usize = 32;

/// KEYS and ARGV of one `lua/check.lua` call for `requests` (the script's header has the
/// layout): a bucket that an earlier request of the call named with the same rule is sent as a
/// reference to it and its need, and the first is flagged to be kept between checks.
fn encode_call(clock: i64, requests: &[Pending]) -> (Vec<Key>, Vec<Value>) {
    let nbuckets: usize = requests.iter().map(|r| r.keys.len()).sum();
    let mut keys = Vec::with_capacity(2 * nbuckets);
    let mut pages = Vec::with_capacity(nbuckets);
    let mut args = Vec::with_capacity(2 + requests.len() + ARGS_PER_BUCKET * nbuckets);
    args.push(Value::Integer(clock));
    args.push(Value::Integer(requests.len() as i64));
    // Each bucket sent in full: where its flags are in `args`, and its numbers.
    let mut sent: SmallVec<[(usize, &[i64]); 8]> = SmallVec::new();
    for r in requests {
        args.push(Value::Integer(r.keys.len() as i64));
        let buckets = r
            .keys
            .iter()
            .zip(&r.pages)
            .zip(r.args.chunks_exact(ARGS_PER_BUCKET));
        for ((key, page), rule) in buckets {
            let need = rule[NEED];
            let mut repeat = None;
            for (e, &(flags_at, first)) in sent.iter().enumerate().take(REPEAT_SCAN) {
                if keys[e] != *key {
                    continue;
                }
                // Named again: kept between its checks, whatever the rule.
                args[flags_at] = Value::Integer(first[FLAGS] | KEEP);
                let same = |i: usize| i == NEED || first[i] == rule[i];
                if (0..ARGS_PER_BUCKET).all(same) {
                    repeat = Some(e);
                    break;
                }
            }
            match repeat {
                Some(e) => args.extend([Value::Integer(-(e as i64 + 1)), Value::Integer(need)]),
                None => {
                    sent.push((args.len() + FLAGS, rule));
                    keys.push(key.clone());
                    pages.push(page.clone());
                    let sent_args = if rule[FLAGS] & BLOCK != 0 {
                        ARGS_PER_BUCKET
                    } else {
                        ARGS_PER_BUCKET - 1
                    };
                    args.extend(rule[..sent_args].iter().map(|&v| Value::Integer(v)));
                }
            }
        }
    }
    keys.extend(pages);
    (keys, args)
}

/// The queue: checks that found every call slot taken wait here, and go together (per hash
/// slot in a cluster) in the next call as soon as a slot frees. Ends when the store is dropped.
pub(super) async fn run_queue(shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Pending>) {
    let permits = shared.permits.clone();
    let mut held: Option<Pending> = None;
    loop {
        let first = match held.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        // A caller that gave up while its check waited (a timeout) is not charged for it.
        if first.reply.is_closed() {
            continue;
        }
        let mut keys = first.keys.len();
        let slot = first.slot;
        let mut requests = vec![first];
        while requests.len() < MAX_REQUESTS_PER_CALL {
            let Ok(next) = rx.try_recv() else { break };
            if next.reply.is_closed() {
                continue;
            }
            if next.slot != slot || keys + next.keys.len() > MAX_KEYS_PER_CALL {
                // Another slot (or a full call): it leads the next call.
                held = Some(next);
                break;
            }
            keys += next.keys.len();
            requests.push(next);
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            shared.call(requests).await;
            drop(permit);
        });
    }
}

/// Reads `{now, allowed_1, tokens, wait, …, allowed_2, …}` for requests whose buckets' longest
/// waits are `sizes` (one slice a request, one wait a bucket).
fn parse_reply(sizes: &[&[u64]], reply: Value) -> Result<Vec<Result<Outcome, StoreError>>, StoreError> {
    let bad = |what: String| StoreError::Protocol(format!("lua/check.lua answered {what}"));
    let Value::Array(items) = reply else {
        return Err(bad(format!("{reply:?}, not an array")));
    };
    let expected = 1 + sizes.iter().map(|n| 1 + 2 * n.len()).sum::<usize>();
    if items.len() != expected {
        return Err(bad(format!("{} values, not {expected}", items.len())));
    }
    let num = |i: usize| -> Result<i64, StoreError> {
        int(&items[i]).ok_or_else(|| bad(format!("{:?} at {}, not an integer", items[i], i + 1)))
    };
    let now_us = u64::try_from(num(0)?).map_err(|_| bad("a negative now".into()))?;
    let mut at = 1;
    let mut out = Vec::with_capacity(sizes.len());
    for &waits in sizes {
        let n = waits.len();
        let admitted = num(at)?;
        at += 1;
        let admitted = match admitted {
            0 => false,
            1 => true,
            -1 => {
                at += 2 * n;
                out.push(Err(StoreError::Protocol(
                    "a bucket of this request holds a value lua/check.lua did not write".into(),
                )));
                continue;
            }
            other => return Err(bad(format!("admitted = {other}"))),
        };
        let mut buckets = SmallVec::with_capacity(n);
        for &max_wait in waits {
            let tokens = u64::try_from(num(at)?).map_err(|_| bad("negative tokens".into()))?;
            // -1: never; -2 - w: blocked, for w more microseconds.
            let (wait_us, blocked) = match num(at + 1)? {
                -1 => (None, false),
                w if w <= -2 => (Some((-2 - w) as u64), true),
                w => (
                    Some(u64::try_from(w).map_err(|_| bad(format!("wait {w}")))?),
                    false,
                ),
            };
            at += 2;
            buckets.push(BucketVerdict {
                sufficient: !blocked && matches!(wait_us, Some(w) if w <= max_wait),
                tokens,
                wait_us,
                blocked,
            });
        }
        out.push(Ok(Outcome {
            admitted,
            now_us,
            buckets,
            source: Source::Store,
            leased: 0,
        }));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_limit::bucket::BucketParams;

    #[test]
    fn reply_is_read_strictly() {
        let v = |xs: &[i64]| Value::Array(xs.iter().map(|&x| Value::Integer(x)).collect());
        let out = parse_reply(&[&[0], &[0, 0]], v(&[17, 0, 5, -1, 1, 3, 0, 4, 0])).unwrap();
        let first = out[0].as_ref().unwrap();
        assert!(!first.admitted);
        assert_eq!(first.now_us, 17);
        assert_eq!(first.buckets[0].wait_us, None);
        assert!(!first.buckets[0].sufficient);
        let second = out[1].as_ref().unwrap();
        assert!(second.admitted && second.buckets.len() == 2 && second.buckets[1].tokens == 4);
        let corrupt = parse_reply(&[&[0], &[0]], v(&[17, -1, 0, 0, 1, 9, 0])).unwrap();
        assert!(corrupt[0].is_err() && corrupt[1].is_ok());
        assert!(parse_reply(&[&[0, 0]], v(&[17, 1, 1, 0])).is_err());
        assert!(parse_reply(&[&[]], v(&[17, 2])).is_err());
        // A queueing bucket pays a wait up to its longest, and no more.
        let queued = parse_reply(&[&[100], &[100]], v(&[17, 1, 0, 100, 0, 0, 101])).unwrap();
        assert!(queued[0].as_ref().unwrap().buckets[0].sufficient);
        assert!(!queued[1].as_ref().unwrap().buckets[0].sufficient);
        // A blocked bucket: -2 - the microseconds left.
        let blocked = parse_reply(&[&[0]], v(&[17, 0, 9, -2 - 5_000])).unwrap();
        let b = blocked[0].as_ref().unwrap().buckets[0];
        assert!(b.blocked && !b.sufficient && b.wait_us == Some(5_000) && b.tokens == 9);
        assert!(parse_reply(&[], Value::Null).is_err());
    }

    fn item(key: &str, rate: &str, cost: u64, shadow: bool) -> CheckItem {
        let params = BucketParams::new(tollgate_limit::bucket::Rate::parse(rate).unwrap(), 10).unwrap();
        let charge = tollgate_limit::bucket::Charge { params, cost, shadow };
        CheckItem::new(key.into(), charge, 0, crate::FailurePolicy::Local)
    }

    fn ints(args: &[Value]) -> Vec<i64> {
        args.iter().map(|v| int(v).unwrap()).collect()
    }

    /// A bucket named again with its rule goes as a reference and its need, and its first
    /// mention is flagged to be kept; under another rule (or as shadow) it goes in full.
    #[test]
    fn a_call_names_each_bucket_and_rule_once() {
        let a = || item("rl:{k}:a", "5/1s", 1, false);
        let b = item("rl:{k}:b", "5/1s", 2, false);
        let requests = [
            vec![a(), b.clone()],
            vec![item("rl:{k}:a", "5/1s", 3, false)],
            vec![a()],
            vec![
                item("rl:{k}:a", "9/1s", 1, false),
                item("rl:{k}:b", "5/1s", 2, true),
            ],
        ];
        let pending: Vec<Pending> = requests.iter().map(|r| Pending::new(r, false).0).collect();
        let (keys, args) = encode_call(-1, &pending);
        let names: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let (a5, b5, a9) = (
            &pending[0].args[..ARGS_PER_BUCKET],
            &pending[0].args[ARGS_PER_BUCKET..],
            &pending[3].args[..ARGS_PER_BUCKET],
        );
        let b_shadow = &pending[3].args[ARGS_PER_BUCKET..];
        let (page_a, page_b) = (page_of("rl:{k}:a"), page_of("rl:{k}:b"));
        let (page_a, page_b) = (page_a.as_bytes(), page_b.as_bytes());
        let want: [&[u8]; 8] = [
            b"rl:{k}:a",
            b"rl:{k}:b",
            b"rl:{k}:a",
            b"rl:{k}:b",
            page_a,
            page_b,
            page_a,
            page_b,
        ];
        assert_eq!(names, want);
        // None of these blocks: each is sent without its block length.
        let flagged = |rule: &[i64], flags: i64| {
            let mut r = rule.to_vec();
            r[FLAGS] = flags;
            r.truncate(ARGS_PER_BUCKET - 1);
            r
        };
        let mut want = vec![-1, 4, 2];
        want.extend(flagged(a5, KEEP));
        want.extend(flagged(b5, KEEP));
        want.extend([1, -1, a5[NEED] * 3]);
        want.extend([1, -1, a5[NEED]]);
        want.push(2);
        want.extend(flagged(a9, 0));
        want.extend(flagged(b_shadow, 1));
        assert_eq!(ints(&args), want);
        assert_eq!(b_shadow[FLAGS], 1);
    }
}
