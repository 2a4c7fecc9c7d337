-- lua/bucket.lua: the bucket arithmetic and encoding that lua/check.lua, lua/lease.lua and
-- lua/refund.lua share. Redis scripts can't load modules, so the gateway puts this file in front
-- of each script when it loads them (src/store/redis.rs); each script's SHA-1 covers both parts.
--
-- It is src/limit/bucket.rs (`rescale`, `refill`) in Lua 5.1 doubles. Rule validation keeps
-- every integer below 2^53, where doubles are exact for +, - and *, but `/` rounds: every
-- integer division goes through math.fmod, which is exact, so the quotient's division has an
-- exact result.
--
-- A bucket is one string of 18 bytes, struct '<I7I7I4': tokens (units), ts (microseconds) and
-- scale (the units per token the tokens are counted in, so a changed rule can convert them),
-- written with SET ... PX ttl.

-- Redis before 5 replicates scripts verbatim unless told otherwise; TIME needs effects.
if redis.replicate_commands then
  redis.replicate_commands()
end

local fmod, floor = math.fmod, math.floor
local pack, unpack = struct.pack, struct.unpack
local STATE = '<I7I7I4'

-- The time a call uses: ARGV's clock argument, or -1 for the store's TIME. nil if not a number.
local function clock_now(arg)
  local now = tonumber(arg)
  if now ~= nil and now < 0 then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return now
end

-- ceil(a / b) for integers a >= 0, b > 0, exactly.
local function div_ceil(a, b)
  local r = fmod(a, b)
  local q = (a - r) / b
  if r > 0 then
    return q + 1
  end
  return q
end

-- bucket.rs `rescale`: whole tokens exactly, the fraction through one double division and one
-- multiplication, rounded down.
local function rescale(tokens, from, to)
  if from == to or from == 0 then
    return tokens
  end
  local frac = fmod(tokens, from)
  local whole = (tokens - frac) / from
  return whole * to + floor((frac / from) * to)
end

-- bucket.rs `refill` of the value stored at a key: a missing bucket starts full; a stored one is
-- converted to this rule's scale, clamped to its capacity, then refilled for the time since ts
-- (never negative). nil when the key holds a value these scripts did not write.
local function refilled(stored, scale, cap, refill, now)
  if not stored then
    return cap
  end
  if #stored ~= 18 then
    return nil
  end
  local s_tokens, s_ts, s_scale = unpack(STATE, stored)
  local t = rescale(s_tokens, s_scale, scale)
  if t >= cap then
    return cap
  end
  local elapsed = now - s_ts
  if elapsed < 0 then
    elapsed = 0
  end
  if elapsed >= div_ceil(cap - t, refill) then
    return cap
  end
  return t + elapsed * refill
end

-- Writes a bucket back: tokens at `ts` (now, or later for a bucket in debt), in `scale` units,
-- expiring `ttl` milliseconds after `ts`: a debt must outlive its repayment, then the bucket's
-- fill time, like any other bucket.
local function save(key, t, ts, scale, ttl, now)
  local px = tonumber(ttl)
  if now ~= nil and ts > now then
    px = px + div_ceil(ts - now, 1000)
  end
  redis.call('SET', key, pack(STATE, t, ts, scale), 'PX', px)
end

-- bucket.rs `owed_us`: the microseconds of refill a post-paid bucket (debt > 0) still owes. A
-- bucket in debt is stored empty with its ts in the future, when refill has paid it back.
local function owed(stored, debt, now)
  if debt <= 0 or not stored or #stored ~= 18 then
    return 0
  end
  local s_tokens, s_ts = unpack(STATE, stored)
  if s_tokens == 0 and s_ts > now then
    return s_ts - now
  end
  return 0
end

-- bucket.rs `balance`: the bucket at now as signed units, below zero while it owes, never below
-- -debt. nil when the key holds a value these scripts did not write.
local function balance(stored, scale, cap, refill, debt, now)
  local o = owed(stored, debt, now)
  if o == 0 then
    return refilled(stored, scale, cap, refill, now)
  end
  if o >= div_ceil(debt, refill) then
    return -debt
  end
  local b = o * refill
  if b > debt then
    b = debt
  end
  return -b
end

-- bucket.rs `at_balance`: the tokens and ts that hold `b` units at now.
local function at_balance(b, refill, now)
  if b >= 0 then
    return b, now
  end
  return 0, now + div_ceil(-b, refill)
end

