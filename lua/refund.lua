-- lua/refund.lua: changes the buckets of one answered request by what the gateway learned after
-- the check, run by the store as one atomic step over all of them. Two uses:
--   * a refund: what lua/check.lua charged, given back for an admitted request that the gateway
--     then could not deliver (the upstream refused the connection, the write failed), or whose
--     answer a `charge_on` limit does not keep;
--   * a post-paid debit: what the upstream reported the request cost (`cost_from_response`)
--     beyond the reserve the check took, taken now, down to the limit's debt floor.
-- It is `adjust` of src/limit/bucket.rs on each bucket; tests/redis_equivalence.rs holds them to
-- each other.
--
-- KEYS              the buckets to change, e.g. rl:{k7}:plan; the gateway leaves out those it
--                   does not change. Then the page of each (see lua/bucket.lua), in the same
--                   order. In a cluster they share one hash slot (the tenant).
-- ARGV[1]           the clock: -1 reads the store's TIME (the default); any other value is the
--                   gateway's now in microseconds (`--clock gateway`).
-- ARGV[2 + 7(i-1) ... 8 + 7(i-1)], the rule of bucket i (KEYS[i]), in integers:
--   scale           units per whole token
--   refill          units added per microsecond
--   capacity        burst x scale, the most units the bucket holds
--   units           what to add: a refund's cost x scale (above 0), a debit's (below 0)
--   ttl             key expiry in milliseconds, at least b / r
--   debt            units the bucket may owe (max_debt x scale), 0 for a limit that can't
--   queue           1 for a limit that queues (`delay`), whose debt is turns handed out: while
--                   it owes, a refund gives nothing back (a newcomer would get a turn on top
--                   of one still waiting); 0 for every other limit
--
-- Returns an array of integers: [1] now, the microseconds this call used, then the balance of
-- each bucket after the change, in KEYS order: units held, or below 0 the units owed.
--
-- Each bucket is refilled to now, gets its units and is kept between -debt and its capacity. A
-- refund at the check's now leaves a bucket holding what it would hold had the request never
-- been checked. A bucket below zero is stored empty with its ts ahead of now, when refill will
-- have repaid it (lua/check.lua reads it so). If any key holds a value these scripts did not
-- write, the script answers an error and writes nothing: all or nothing, as the check.
--
-- The bucket encoding and arithmetic come from lua/bucket.lua, loaded in front of this script.

local nkeys = #KEYS / 2
if nkeys % 1 ~= 0 or #ARGV ~= 1 + 7 * nkeys then
  return redis.error_reply('refund.lua: KEYS must be buckets then their pages, ARGV clock and 7 numbers per bucket; got '
    .. #ARGV .. ' ARGV for ' .. #KEYS .. ' keys')
end

local now = clock_now(ARGV[1])
if now == nil then
  return redis.error_reply('refund.lua: ARGV[1] must be -1 or microseconds')
end

-- First pass: read every bucket, so a bad one stops the call before any write.
local balances = {}
for i = 1, nkeys do
  local a = 1 + 7 * (i - 1)
  local scale = tonumber(ARGV[a + 1])
  local refill = tonumber(ARGV[a + 2])
  local cap = tonumber(ARGV[a + 3])
  local units = tonumber(ARGV[a + 4])
  local debt = tonumber(ARGV[a + 6])
  local queue = tonumber(ARGV[a + 7])
  if scale == nil or refill == nil or cap == nil or units == nil or debt == nil or queue == nil or refill <= 0 then
    return redis.error_reply('refund.lua: the numbers of ' .. KEYS[i] .. ' must be integers, refill above 0')
  end
  local b = balance(load(KEYS[i], KEYS[nkeys + i], now), scale, cap, refill, debt, now)
  if b == nil then
    return redis.error_reply('refund.lua: ' .. KEYS[i] .. ' does not hold a bucket these scripts wrote')
  end
  if units > 0 and queue == 1 and b < 0 then
    units = 0
  end
  b = b + units
  if b > cap then
    b = cap
  elseif b < -debt then
    b = -debt
  end
  balances[i] = b
end

local out = { now }
for i = 1, nkeys do
  local a = 1 + 7 * (i - 1)
  local t, ts = at_balance(balances[i], tonumber(ARGV[a + 2]), now)
  save(KEYS[i], KEYS[nkeys + i], t, ts, tonumber(ARGV[a + 1]), ARGV[a + 5], now)
  out[#out + 1] = balances[i]
end
return out
