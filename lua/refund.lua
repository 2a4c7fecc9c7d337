-- lua/refund.lua: gives back what lua/check.lua charged for one admitted request that the
-- gateway then could not deliver (the upstream refused the connection, the write failed), run by
-- the store as one atomic step over all of the request's buckets. It is `refund_all` of
-- src/limit/bucket.rs (`give_back` on each charged bucket); tests/redis_equivalence.rs holds
-- them to each other.
--
-- KEYS              the buckets the check charged, e.g. rl:{k7}:plan; the gateway leaves out
--                   those it did not charge. In a cluster they share one hash slot (the tenant).
-- ARGV[1]           the clock: -1 reads the store's TIME (the default); any other value is the
--                   gateway's now in microseconds (`--clock gateway`).
-- ARGV[2 + 5(i-1) ... 6 + 5(i-1)], the rule of bucket i (KEYS[i]), in integers:
--   scale           units per whole token
--   refill          units added per microsecond
--   capacity        burst x scale, the most units the bucket holds
--   units           what the check took: cost x scale (at most the capacity)
--   ttl             key expiry in milliseconds, at least b / r
--
-- Returns an array of integers: [1] now, the microseconds this call used, then the units in each
-- bucket after the refund, in KEYS order.
--
-- Each bucket is refilled to now, gets its units back and is capped at its capacity, so it holds
-- what it would hold had the request never been checked. If any key holds a value these scripts
-- did not write, the script answers an error and writes nothing: all or nothing, as the check.
--
-- The bucket encoding and arithmetic come from lua/bucket.lua, loaded in front of this script.

local nkeys = #KEYS
if #ARGV ~= 1 + 5 * nkeys then
  return redis.error_reply('refund.lua: ARGV must be clock and 5 numbers per key; got '
    .. #ARGV .. ' ARGV for ' .. nkeys .. ' keys')
end

local now = clock_now(ARGV[1])
if now == nil then
  return redis.error_reply('refund.lua: ARGV[1] must be -1 or microseconds')
end

-- First pass: read and refill every bucket, so a bad one stops the call before any write.
local tokens = {}
for i = 1, nkeys do
  local a = 1 + 5 * (i - 1)
  local scale = tonumber(ARGV[a + 1])
  local refill = tonumber(ARGV[a + 2])
  local cap = tonumber(ARGV[a + 3])
  local units = tonumber(ARGV[a + 4])
  if scale == nil or refill == nil or cap == nil or units == nil or refill <= 0 then
    return redis.error_reply('refund.lua: the numbers of ' .. KEYS[i] .. ' must be integers, refill above 0')
  end
  local t = refilled(redis.call('GET', KEYS[i]), scale, cap, refill, now)
  if t == nil then
    return redis.error_reply('refund.lua: ' .. KEYS[i] .. ' does not hold an 18-byte bucket')
  end
  t = t + units
  if t > cap then
    t = cap
  end
  tokens[i] = t
end

local out = { now }
for i = 1, nkeys do
  local a = 1 + 5 * (i - 1)
  save(KEYS[i], tokens[i], now, tonumber(ARGV[a + 1]), ARGV[a + 5])
  out[#out + 1] = tokens[i]
end
return out
