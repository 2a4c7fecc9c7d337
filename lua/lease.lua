-- lua/lease.lua: LEASE and GIVE BACK for a key too hot for one shard, run by the store as one
-- atomic step. It is the arithmetic of src/limit/lease.rs (`lease`, `give_back`) on the bucket
-- of src/limit/bucket.rs (`rescale`, `refill`), and it reads and writes the very bucket that
-- lua/check.lua does, in the same encoding: a leased limit keeps its one bucket, and a request
-- that can't use a lease is checked against it directly. tests/lease_equivalence.rs holds it to the
-- Rust side, check.lua calls included.
--
-- KEYS[1]           the bucket, e.g. rl:{kbig}:plan.
-- KEYS[2]           its page (see lua/bucket.lua).
-- ARGV[1]           the clock: -1 reads the store's TIME (the default); any other value is the
--                   gateway's now in microseconds (`--clock gateway`).
-- ARGV[2]           the operation: 'lease' or 'give'.
-- ARGV[3]           scale      units per whole token
-- ARGV[4]           refill     units added per microsecond
-- ARGV[5]           capacity   burst x scale, the most units the bucket holds
-- ARGV[6]           units      lease: the whole block, B x scale (at most the capacity);
--                              give: the unused tokens given back, x scale (capped by the caller
--                              at the capacity, which is all a give can ever add)
-- ARGV[7]           ttl        key expiry in milliseconds, at least b / r
-- ARGV[8]           cycle      lease: one block cycle N x B / r in microseconds, rounded up (the
--                              gateway computes it: it knows N); give: ignored, send 0
--
-- Returns an array of four integers:
--   [1] granted     lease: 1 if the whole block was taken, 0 if nothing was; give: 0
--   [2] now         the microseconds this call used (TIME, or ARGV[1])
--   [3] tokens      units left in the bucket after the call
--   [4] until       lease refused: now + cycle, the store time before which this gateway should
--                   not ask again (it adds its own 0-50 ms of jitter); otherwise 0
--
-- A lease grants a whole block or nothing: a partial grant would bring the gateway straight
-- back, one call per request. A give adds the unused tokens to the refilled bucket and never
-- takes it above its capacity. Both write the refilled state back into the bucket's field of its
-- page, as a check does.
--
-- The bucket encoding and arithmetic come from lua/bucket.lua, loaded in front of this script.

if #KEYS ~= 2 or #ARGV ~= 8 then
  return redis.error_reply('lease.lua: expected 2 keys (the bucket, its page) and 8 ARGV, got ' .. #KEYS .. ' and ' .. #ARGV)
end

local now = clock_now(ARGV[1])
if now == nil then
  return redis.error_reply('lease.lua: ARGV[1] must be -1 or microseconds')
end

local op = ARGV[2]
local scale = tonumber(ARGV[3])
local refill = tonumber(ARGV[4])
local cap = tonumber(ARGV[5])
local units = tonumber(ARGV[6])
local cycle = tonumber(ARGV[8])
if op ~= 'lease' and op ~= 'give' then
  return redis.error_reply("lease.lua: ARGV[2] must be 'lease' or 'give', got " .. tostring(op))
end
if scale == nil or refill == nil or cap == nil or units == nil or cycle == nil or refill <= 0 then
  return redis.error_reply('lease.lua: ARGV[3..8] must be integers, refill above 0')
end

local t = refilled(load(KEYS[1], KEYS[2], now), scale, cap, refill, now)
if t == nil then
  return redis.error_reply('lease.lua: ' .. KEYS[1] .. ' does not hold a bucket these scripts wrote')
end

local granted, untl = 0, 0
if op == 'lease' then
  if t >= units then
    t = t - units
    granted = 1
  else
    untl = now + cycle
  end
else
  t = t + units
  if t > cap then
    t = cap
  end
end

save(KEYS[1], KEYS[2], t, now, scale, ARGV[7], now)
return { granted, now, t, untl }
