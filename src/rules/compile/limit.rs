//! The `limits` of a rules file: each limit's numbers, what it keys on, how it fails, its
//! post-paid debit and its leases.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::HeaderName;
use tollgate_limit::batch::{FailurePolicy, LeaseBlock};
use tollgate_limit::bucket::BucketParams;

use crate::compile::{Compiler, Limits};
use crate::keys::KeysBuilder;
use crate::raw::{RawBlock, RawDimension, RawDimensionName, RawLimit, RawNumbers, RawRules};
use crate::{
    Concurrent, Dimension, Limit, LimitClass, Mode, Numbers, PostPaid, RulesError, Scope, headers, identity,
    jwt,
};

impl Compiler<'_> {
    pub(super) fn limits<'r>(&self, raw: &'r RawRules) -> Result<Limits<'r>, RulesError> {
        let mut limits = Limits {
            list: Vec::new(),
            by_name: BTreeMap::new(),
        };
        for (name, l) in &raw.limits {
            let limit = self.limit(name, l)?;
            limits.by_name.insert(name.as_str(), limits.list.len());
            limits.list.push(limit);
        }
        // Routes and the unauthenticated charge name a limit by a u16 index.
        if limits.list.len() > u16::MAX as usize {
            return Err(self.err("limits", "too many limits"));
        }
        Ok(limits)
    }

    pub(super) fn limit(&self, name: &str, l: &RawLimit) -> Result<Limit, RulesError> {
        let field = format!("limits.{name}");
        self.check_limit_name(&field, name)?;
        let dimension = self.dimension(&field, &l.dimension)?;
        let ip_prefixes = self.ip_prefixes(&field, l, &dimension)?;
        if let Some(max) = l.concurrent {
            return self.concurrent_limit(&field, name, l, dimension, max);
        }
        let numbers = self.limit_numbers(&field, name, l, &dimension)?;
        let policy = self.failure_policy(&field, l)?;
        let lease = self.lease(&field, l, &dimension)?;
        if let (Some(block), Some(n)) = (lease, &numbers) {
            self.check_leasable(&field, &n.params, block)?;
        }
        if l.scope == Scope::Global {
            self.check_global(&field, l, &dimension, lease.is_some())?;
        }
        let charge_on = self.charge_on(&field, l, lease.is_some())?;
        let home_region = self.home_region(&field, l)?;
        let plans = self.plans(&field, name, l, &dimension)?;
        let post_paid = self.post_paid(&field, l, lease.is_some())?;
        let max_wait_us = self.delay(&field, l, lease.is_some())?;
        let block_us = self.block_for(&field, l, lease.is_some())?;
        Ok(Limit {
            max_wait_us,
            block_us,
            post_paid,
            plans,
            name: name.into(),
            dimension,
            numbers,
            mode: l.mode,
            class: l.class,
            policy,
            lease,
            scope: l.scope,
            concurrent: None,
            charge_on,
            home_region,
            ip_prefixes,
        })
    }

    /// A limit's name goes into bucket names and metric labels, so it keeps to a plain alphabet.
    fn check_limit_name(&self, field: &str, name: &str) -> Result<(), RulesError> {
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(self.err(field, "a limit name uses only letters, digits, '-', '_' and '.'"));
        }
        Ok(())
    }

    /// `rate` and `burst`, both or neither; neither only on a key limit, whose keys set them.
    fn limit_numbers(
        &self,
        field: &str,
        name: &str,
        l: &RawLimit,
        dimension: &Dimension,
    ) -> Result<Option<Numbers>, RulesError> {
        match (&l.rate, l.burst) {
            (Some(rate), Some(burst)) => Ok(Some(self.numbers(field, name, rate, burst)?)),
            (None, None) if *dimension == Dimension::Key => Ok(None),
            (None, None) => Err(self.err(
                field,
                "needs \"rate\" and \"burst\" (only key limits may leave them to each key)",
            )),
            (Some(_), None) => Err(self.err(format!("{field}.burst"), "missing: a rate needs a burst")),
            (None, Some(_)) => Err(self.err(format!("{field}.rate"), "missing: a burst needs a rate")),
        }
    }

    fn failure_policy(&self, field: &str, l: &RawLimit) -> Result<FailurePolicy, RulesError> {
        let policy = l.on_store_failure.unwrap_or(FailurePolicy::Local);
        if l.class == LimitClass::Security && policy == FailurePolicy::Open {
            return Err(self.err(
                format!("{field}.on_store_failure"),
                "a security limit may not fail open; use \"local\" or \"closed\"",
            ));
        }
        Ok(policy)
    }

    /// A global limit is one key number the Regions share out, so nothing else may move it.
    fn check_global(
        &self,
        field: &str,
        l: &RawLimit,
        dimension: &Dimension,
        leased: bool,
    ) -> Result<(), RulesError> {
        if *dimension != Dimension::Key {
            return Err(self.err(
                format!("{field}.scope"),
                "only key limits can be global: each key's number is what the Regions share",
            ));
        }
        if l.class == LimitClass::Security {
            return Err(self.err(
                format!("{field}.scope"),
                "a security limit is not shared out; give it a \"home_region\" instead",
            ));
        }
        if leased {
            return Err(self.err(
                format!("{field}.lease"),
                "a global limit's share moves every rebalance; it is not leased",
            ));
        }
        Ok(())
    }

    /// `charge_on.status`: the answers that keep the charge, sorted and without repeats.
    fn charge_on(&self, field: &str, l: &RawLimit, leased: bool) -> Result<Option<Box<[u16]>>, RulesError> {
        let Some(c) = &l.charge_on else {
            return Ok(None);
        };
        if leased {
            return Err(self.err(
                format!("{field}.charge_on"),
                "a limit charged on the answer gives charges back, so it is not leased",
            ));
        }
        if c.status.is_empty() {
            return Err(self.err(format!("{field}.charge_on.status"), "name at least one status"));
        }
        if let Some(bad) = c.status.iter().find(|s| !(100..=599).contains(*s)) {
            return Err(self.err(
                format!("{field}.charge_on.status"),
                format!("{bad} is not an HTTP status (100 to 599)"),
            ));
        }
        let mut s = c.status.clone();
        s.sort_unstable();
        s.dedup();
        Ok(Some(s.into_boxed_slice()))
    }

    /// The Region whose store keeps a security limit's buckets.
    fn home_region(&self, field: &str, l: &RawLimit) -> Result<Option<Arc<str>>, RulesError> {
        let Some(r) = &l.home_region else {
            return Ok(None);
        };
        if l.class != LimitClass::Security {
            return Err(self.err(
                format!("{field}.home_region"),
                "only a security limit (\"class\": \"security\") has a home Region",
            ));
        }
        if r.is_empty()
            || !r
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(self.err(
                format!("{field}.home_region"),
                format!("{r:?} is not a Region name (letters, digits, - and _)"),
            ));
        }
        Ok(Some(Arc::from(r.as_str())))
    }

    /// `cost_from_response`, `reserve` and `max_debt`: a limit whose cost the upstream's answer
    /// reports. Its charges are settled after the answer, so nothing that gives charges back
    /// or takes them ahead (leases, `charge_on`) or moves its numbers (a global share) goes
    /// with it.
    pub(super) fn post_paid(
        &self,
        field: &str,
        l: &RawLimit,
        leased: bool,
    ) -> Result<Option<PostPaid>, RulesError> {
        let Some(c) = &l.cost_from_response else {
            for (name, set) in [
                ("reserve", l.reserve.is_some()),
                ("max_debt", l.max_debt.is_some()),
            ] {
                if set {
                    return Err(self.err(
                        format!("{field}.{name}"),
                        "only a post-paid limit (with \"cost_from_response\") takes a reserve or a debt",
                    ));
                }
            }
            return Ok(None);
        };
        let header = http::HeaderName::from_bytes(c.header.as_bytes()).map_err(|_| {
            self.err(
                format!("{field}.cost_from_response.header"),
                format!("{:?} is not a header name", c.header),
            )
        })?;
        for (name, clash) in [
            ("lease", leased),
            ("charge_on", l.charge_on.is_some()),
            ("scope", l.scope == Scope::Global),
        ] {
            if clash {
                return Err(self.err(
                    format!("{field}.{name}"),
                    "a post-paid limit (\"cost_from_response\") settles each charge after the answer; it takes no lease, charge_on or global scope",
                ));
            }
        }
        let reserve = l.reserve.unwrap_or(1);
        if reserve == 0 {
            return Err(self.err(
                format!("{field}.reserve"),
                "must be at least 1: a request is admitted only while its bucket holds its reserve",
            ));
        }
        Ok(Some(PostPaid {
            header,
            reserve,
            max_debt: l.max_debt,
        }))
    }

    /// `delay`: the longest wait of a limit that queues rather than refuses, in microseconds
    /// (0 for one that refuses). A queue spends the shared bucket ahead of time, so nothing
    /// that spends it elsewhere (leases), settles it later (post-paid) or shares its numbers
    /// out (global scope) goes with it.
    fn delay(&self, field: &str, l: &RawLimit, leased: bool) -> Result<u64, RulesError> {
        let Some(d) = l.delay else { return Ok(0) };
        for (name, clash) in [
            ("lease", leased),
            ("cost_from_response", l.cost_from_response.is_some()),
            ("scope", l.scope == Scope::Global),
        ] {
            if clash {
                return Err(self.err(
                    format!("{field}.{name}"),
                    "a limit that queues (\"delay\") spends its shared bucket ahead of time; it takes no lease, cost_from_response or global scope",
                ));
            }
        }
        if !(1..=60_000).contains(&d.max_wait_ms) {
            return Err(self.err(
                format!("{field}.delay.max_wait_ms"),
                format!(
                    "{} is out of range: a request may wait 1 to 60000 ms for its tokens",
                    d.max_wait_ms
                ),
            ));
        }
        Ok(d.max_wait_ms * 1_000)
    }

    /// `block_for`: how long a bucket that refused a request stays blocked, in microseconds (0
    /// for a limit that doesn't block). A leased block is spent in one gateway's memory, where
    /// the store's block can't stop it, so a blocking limit is not leased.
    fn block_for(&self, field: &str, l: &RawLimit, leased: bool) -> Result<u64, RulesError> {
        let Some(text) = &l.block_for else { return Ok(0) };
        if leased {
            return Err(self.err(
                format!("{field}.lease"),
                "a limit that blocks (\"block_for\") is decided in the store; it takes no lease",
            ));
        }
        let d = tollgate_limit::clock::parse_duration(text)
            .map_err(|e| self.err(format!("{field}.block_for"), e))?;
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        if !(1_000_000..=86_400_000_000).contains(&us) {
            return Err(self.err(
                format!("{field}.block_for"),
                format!("{text:?} is out of range: a block lasts 1s to 24h"),
            ));
        }
        Ok(us)
    }

    /// Lets every bucket of each post-paid limit owe down to its debt, and of each queueing
    /// limit its longest wait's worth of tokens, and gives a blocking limit's buckets their
    /// block: the limit's numbers, its plans' and each key's.
    pub(super) fn owing(&self, limits: &mut Limits, keys: &mut KeysBuilder) -> Result<(), RulesError> {
        let owe = |field: String, n: &mut Numbers, l: (Option<&PostPaid>, u64, u64)| {
            let (post_paid, max_wait_us, block_us) = l;
            n.params = match post_paid {
                Some(pp) => n
                    .params
                    .with_debt(pp.max_debt.unwrap_or(n.params.burst))
                    .map_err(|e| self.err(format!("{field}.max_debt"), e.to_string()))?,
                None if max_wait_us > 0 => n
                    .params
                    .with_delay(max_wait_us)
                    .map_err(|e| self.err(format!("{field}.delay.max_wait_ms"), e.to_string()))?,
                None => n.params,
            };
            n.params.block_us = block_us;
            Ok::<(), RulesError>(())
        };
        for (li, l) in limits.list.iter_mut().enumerate() {
            if l.post_paid.is_none() && l.max_wait_us == 0 && l.block_us == 0 {
                continue;
            }
            let (pp, wait, block) = (l.post_paid.clone(), l.max_wait_us, l.block_us);
            let how = (pp.as_ref(), wait, block);
            let field = format!("limits.{}", l.name);
            if let Some(n) = &mut l.numbers {
                owe(field.clone(), n, how)?;
            }
            if let Some(p) = &mut l.plans {
                for (plan, n) in p.numbers.iter_mut() {
                    owe(format!("{field}.plans.{plan}"), n, how)?;
                }
            }
            // Keys that write the same numbers share them: each is owed once, and an error
            // names the first key that wrote them.
            for (_, ki, n) in keys.numbers_mut().filter(|(l, _, _)| *l as usize == li) {
                owe(format!("keys[{ki}].limits.{}", l.name), n, how)?;
            }
        }
        Ok(())
    }

    /// `ipv4_prefix` and `ipv6_prefix`, on limits with per-IP buckets only.
    pub(super) fn ip_prefixes(
        &self,
        field: &str,
        l: &RawLimit,
        dimension: &Dimension,
    ) -> Result<identity::IpPrefixes, RulesError> {
        let mut prefixes = identity::IpPrefixes::default();
        for (name, given, max, into) in [
            ("ipv4_prefix", l.ipv4_prefix, 32, &mut prefixes.v4),
            ("ipv6_prefix", l.ipv6_prefix, 128, &mut prefixes.v6),
        ] {
            let Some(bits) = given else { continue };
            if !matches!(dimension, Dimension::Ip | Dimension::Route) {
                return Err(self.err(
                    format!("{field}.{name}"),
                    "only a limit with per-IP buckets takes a prefix: dimension \"ip\", or \"route\" (per IP without a key)",
                ));
            }
            *into = u8::try_from(bits).ok().filter(|b| *b <= max).ok_or_else(|| {
                self.err(
                    format!("{field}.{name}"),
                    format!("{bits} is not a prefix length: use 0 to {max} (the leading bits of a client's address that name one client)"),
                )
            })?;
        }
        Ok(prefixes)
    }

    /// A limit on requests in flight per key: one seat per request, taken before it is
    /// forwarded and given back when its answer ends.
    pub(super) fn concurrent_limit(
        &self,
        field: &str,
        name: &str,
        l: &RawLimit,
        dimension: Dimension,
        max: u32,
    ) -> Result<Limit, RulesError> {
        if max == 0 {
            return Err(self.err(format!("{field}.concurrent"), "must be at least 1"));
        }
        if dimension != Dimension::Key {
            return Err(self.err(
                format!("{field}.concurrent"),
                "only key limits count requests in flight",
            ));
        }
        let other = [
            ("rate", l.rate.is_some()),
            ("burst", l.burst.is_some()),
            ("lease", l.lease.is_some()),
            ("charge_on", l.charge_on.is_some()),
            ("cost_from_response", l.cost_from_response.is_some()),
            ("reserve", l.reserve.is_some()),
            ("max_debt", l.max_debt.is_some()),
            ("delay", l.delay.is_some()),
            ("block_for", l.block_for.is_some()),
            ("quota", l.quota.is_some()),
            ("home_region", l.home_region.is_some()),
            ("scope", l.scope != Scope::Region),
            ("mode", l.mode != Mode::Enforce),
            ("class", l.class != LimitClass::Capacity),
        ];
        if let Some((f, _)) = other.iter().find(|(_, set)| *set) {
            return Err(self.err(
                format!("{field}.{f}"),
                "a limit on requests in flight (\"concurrent\") takes no other numbers or modes",
            ));
        }
        let policy = headers::concurrency_policy_value(name, max).map_err(|e| self.err(field, e))?;
        Ok(Limit {
            name: name.into(),
            dimension,
            numbers: None,
            mode: Mode::Enforce,
            class: LimitClass::Capacity,
            policy: l.on_store_failure.unwrap_or(FailurePolicy::Local),
            lease: None,
            scope: Scope::Region,
            concurrent: Some(Concurrent { max, policy }),
            charge_on: None,
            home_region: None,
            plans: None,
            ip_prefixes: identity::IpPrefixes::default(),
            post_paid: None,
            max_wait_us: 0,
            block_us: 0,
        })
    }

    /// A key limit's numbers per plan, for JWT callers.
    pub(super) fn plans(
        &self,
        field: &str,
        name: &str,
        l: &RawLimit,
        dimension: &Dimension,
    ) -> Result<Option<jwt::Plans>, RulesError> {
        let Some(raw) = &l.plans else {
            if l.plan_claim.is_some() {
                return Err(self.err(
                    format!("{field}.plan_claim"),
                    "names the claim of \"plans\", which is missing",
                ));
            }
            return Ok(None);
        };
        if *dimension != Dimension::Key {
            return Err(self.err(
                format!("{field}.plans"),
                "only key limits have plans: a plan is a tenant's numbers",
            ));
        }
        if raw.is_empty() {
            return Err(self.err(format!("{field}.plans"), "name at least one plan"));
        }
        let claim = match &l.plan_claim {
            Some(c) if c.is_empty() => {
                return Err(self.err(format!("{field}.plan_claim"), "must not be empty"));
            }
            Some(c) => c.clone(),
            None => "plan".to_string(),
        };
        let mut numbers = BTreeMap::new();
        for (plan, RawNumbers { rate, burst }) in raw {
            let n = self.numbers(&format!("{field}.plans.{plan}"), name, rate, *burst)?;
            numbers.insert(plan.clone(), n);
        }
        Ok(Some(jwt::Plans { claim, numbers }))
    }

    pub(super) fn dimension(&self, field: &str, raw: &RawDimension) -> Result<Dimension, RulesError> {
        Ok(match raw {
            RawDimension::Named(RawDimensionName::Key) => Dimension::Key,
            RawDimension::Named(RawDimensionName::Route) => Dimension::Route,
            RawDimension::Named(RawDimensionName::Ip) => Dimension::Ip,
            RawDimension::Named(RawDimensionName::Fingerprint) => Dimension::Fingerprint,
            RawDimension::Claim(c) => {
                if c.is_empty() {
                    return Err(self.err(format!("{field}.dimension.claim"), "must not be empty"));
                }
                Dimension::Claim(c.clone())
            }
            RawDimension::BodyField(f) => {
                if f.is_empty() {
                    return Err(self.err(format!("{field}.dimension.body_field"), "must not be empty"));
                }
                Dimension::BodyField(f.clone())
            }
            RawDimension::Header(h) => {
                Dimension::Header(HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                    self.err(
                        format!("{field}.dimension.header"),
                        format!("{h:?} is not a header name"),
                    )
                })?)
            }
        })
    }

    pub(super) fn lease(
        &self,
        field: &str,
        l: &RawLimit,
        dimension: &Dimension,
    ) -> Result<Option<LeaseBlock>, RulesError> {
        let Some(lease) = &l.lease else {
            return Ok(None);
        };
        if l.class == LimitClass::Security {
            return Err(self.err(format!("{field}.lease"), "a security limit is never leased"));
        }
        if *dimension != Dimension::Key {
            return Err(self.err(format!("{field}.lease"), "only key limits can be leased"));
        }
        match &lease.block {
            RawBlock::Fixed(0) => {
                Err(self.err(format!("{field}.lease.block"), "must be \"auto\" or at least 1"))
            }
            RawBlock::Fixed(n) => Ok(Some(LeaseBlock::Fixed(*n))),
            RawBlock::Auto(s) if s == "auto" => Ok(Some(LeaseBlock::Auto)),
            RawBlock::Auto(s) => Err(self.err(
                format!("{field}.lease.block"),
                format!("{s:?} is neither \"auto\" nor a number"),
            )),
        }
    }

    /// Leasing pays only for hot capacity limits: at least 500 tokens a second. A fixed block
    /// must fit in the bucket, or no lease could ever be granted.
    pub(super) fn check_leasable(
        &self,
        field: &str,
        p: &BucketParams,
        block: LeaseBlock,
    ) -> Result<(), RulesError> {
        if (p.rate.tokens as u128) * 1_000_000 < 500 * p.rate.period_us as u128 {
            return Err(self.err(
                format!("{field}.lease"),
                format!("rate {} is under 500/s; leasing is for hot keys only", p.rate),
            ));
        }
        if let LeaseBlock::Fixed(b) = block
            && b > p.burst
        {
            return Err(self.err(
                format!("{field}.lease.block"),
                format!(
                    "block {b} is above the burst {}: the bucket could never hold a whole block",
                    p.burst
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{base, err};

    #[test]
    fn a_rate_without_a_burst_is_refused() {
        let mut rules = base();
        rules["limits"]["per_key"]
            .as_object_mut()
            .unwrap()
            .remove("burst");
        let e = err(&rules);
        assert_eq!(
            (e.field.as_str(), e.reason.as_str()),
            ("limits.per_key.burst", "missing: a rate needs a burst")
        );
    }

    #[test]
    fn a_limit_name_with_a_space_is_refused() {
        let mut rules = base();
        rules["limits"] = serde_json::json!({"per key": {"dimension": "key", "rate": "1/1s", "burst": 1}});
        rules["routes"][0]["cost"] = serde_json::json!({});
        let e = err(&rules);
        assert!(e.reason.contains("a limit name uses only"), "{e}");
    }
}
