-- lua/lease.lua: LEASE and GIVE BACK for a key too hot for one shard, run by the store as one
-- atomic step. It is the arithmetic of src/limit/lease.rs (`lease`, `give_back`) on the bucket
-- of src/limit/bucket.rs (`rescale`, `refill`), and it reads and writes the very bucket that
-- lua/check.lua does, in the same encoding: a leased limit keeps its one bucket, and a request
-- that can't use a lease is checked against it directly. tests/lease_equivalence.rs holds it to the
-- Rust side, check.lua calls included.
--
-- KEYS[1]           the bucket, e.g. rl:{kbig}:plan.
-- KEYS[2]           its page (see lua/bucket.lua).
-- KEYS[3]           its records of outstanding grants, e.g. rl:{kbig}:plan|held: the same hash
--                   tag, so one script on one shard touches both (see "Records" below).
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
-- ARGV[9]           holder     the calling gateway's id, picked at its start
-- ARGV[10]          spent      whole tokens it spent from its blocks since its last call here
-- ARGV[11]          hold       microseconds a record lasts after its holder's last call
--
-- Returns an array of six integers:
--   [1] granted     lease: 1 if the whole block was taken, 0 if nothing was; give: 0
--   [2] now         the microseconds this call used (TIME, or ARGV[1])
--   [3] tokens      units left in the bucket after the call
--   [4] until       lease refused: now + cycle, the store time before which this gateway should
--                   not ask again (it adds its own 0-50 ms of jitter); otherwise 0
--   [5] reclaimed   whole tokens of expired records put back before the call (before the cap)
--   [6] held        whole tokens in the caller's record after the call
--
-- A lease grants a whole block or nothing: a partial grant would bring the gateway straight
-- back, one call per request. A give adds the unused tokens to the refilled bucket and never
-- takes it above its capacity. Both write the refilled state back into the bucket's field of its
-- page, as a check does.
--
-- The bucket encoding and arithmetic come from lua/bucket.lua, loaded in front of this script.

-- ---- Records: the grants each gateway holds (src/limit/lease.rs `lease_recorded`) ----
--
-- A gateway killed with -9 never gives its blocks back. So KEYS[3] keeps, per gateway (field =
-- its holder id), the whole tokens granted to it and not yet reported spent or given back, and
-- the store time its record expires, hold microseconds after its last call: the value is
-- 'tokens:expires'. Every call first puts the tokens of expired records back in the bucket
-- (capped at the burst, as a give is), then does its lease or give, then updates the caller's
-- record: minus what it gave and reported spent (never below 0), plus what it was granted. A
-- record of 0 is removed. A live gateway calls again before its record expires, so only a
-- gateway that stopped calling is ever reclaimed. These functions touch KEYS[3] only.

-- Every record of the hash, parsed, or nil and the field that holds something else. Nothing is
-- written before the whole hash has been read, so a bad record changes nothing.
local function held_read(hkey)
  local all = redis.call('HGETALL', hkey)
  local recs = {}
  for i = 1, #all, 2 do
    local tok, exp = string.match(all[i + 1], '^(%d+):(%d+)$')
    if tok == nil then
      return nil, all[i]
    end
    recs[#recs + 1] = { all[i], tonumber(tok), tonumber(exp) }
  end
  return recs
end

-- Removes the records expired at now; the tokens they held.
local function held_sweep(hkey, recs, now)
  local back = 0
  for _, r in ipairs(recs) do
    if r[3] <= now then
      back = back + r[2]
      redis.call('HDEL', hkey, r[1])
    end
  end
  return back
end

-- The caller's record after its call, written back with its new expiry; the hash itself
-- expires px milliseconds after this write. Returns the tokens recorded.
local function held_note(hkey, recs, holder, granted, given, spent, now, hold, px)
  local tokens = 0
  for _, r in ipairs(recs) do
    if r[1] == holder and r[3] > now then
      tokens = r[2]
    end
  end
  tokens = tokens - given - spent
  if tokens < 0 then
    tokens = 0
  end
  tokens = tokens + granted
  if tokens == 0 then
    redis.call('HDEL', hkey, holder)
  else
    -- %.0f: tostring would print large integers in exponent form.
    redis.call('HSET', hkey, holder, string.format('%.0f:%.0f', tokens, now + hold))
    redis.call('PEXPIRE', hkey, px)
  end
  return tokens
end

-- ---- the call ----

if #KEYS ~= 3 or #ARGV ~= 11 then
  return redis.error_reply('lease.lua: expected 3 keys (the bucket, its page, its records) and 11 ARGV, got ' .. #KEYS .. ' and ' .. #ARGV)
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
local holder = ARGV[9]
local spent = tonumber(ARGV[10])
local hold = tonumber(ARGV[11])
if holder == '' or spent == nil or spent < 0 or hold == nil or hold <= 0 then
  return redis.error_reply('lease.lua: ARGV[9] must be a holder id, ARGV[10] spent >= 0, ARGV[11] hold > 0')
end

local t = refilled(load(KEYS[1], KEYS[2], now), scale, cap, refill, now)
if t == nil then
  return redis.error_reply('lease.lua: ' .. KEYS[1] .. ' does not hold a bucket these scripts wrote')
end
local recs, bad = held_read(KEYS[3])
if recs == nil then
  return redis.error_reply('lease.lua: ' .. KEYS[3] .. ' field ' .. bad .. " does not hold 'tokens:expires'")
end
-- The whole tokens of this call: a block, or a give of at most the capacity (the caller caps).
local whole = units / scale
local burst = cap / scale

local reclaimed = held_sweep(KEYS[3], recs, now)
if reclaimed > 0 then
  local add = reclaimed
  if add > burst then
    add = burst
  end
  t = t + add * scale
  if t > cap then
    t = cap
  end
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
local given, got = 0, 0
if op == 'give' then
  given = whole
elseif granted == 1 then
  got = whole
end
local px = div_ceil(hold, 1000) + tonumber(ARGV[7])
local held = held_note(KEYS[3], recs, holder, got, given, spent, now, hold, px)
return { granted, now, t, untl, reclaimed, held }
