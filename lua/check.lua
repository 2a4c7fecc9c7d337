-- lua/check.lua: one all-or-nothing token-bucket check of every bucket of one request, run by
-- the store as one atomic step. It is the arithmetic of src/limit/bucket.rs (`rescale`,
-- `refill`, `wait_us`, `check_all`) line for line, so both give the same decisions, the same
-- units left and the same waits; tests/redis_equivalence.rs holds them to it.
--
-- KEYS[i]           bucket i, e.g. rl:{k7}:plan. Every bucket of one call shares one hash tag,
--                   and no name holds a rule version.
-- ARGV[1]           the clock: -1 reads the store's TIME (the default); any other value is the
--                   gateway's now in microseconds (`--clock gateway`, for stores that refuse TIME).
-- ARGV[2 + 6(i-1) ... 7 + 6(i-1)], bucket i's rule, in integers:
--   scale           units per whole token
--   refill          units added per microsecond
--   capacity        burst x scale, the most units the bucket holds
--   need            units this request costs (cost x scale; the gateway caps it at capacity + 1,
--                   which is "more than the bucket can ever hold" and keeps every number exact)
--   ttl             key expiry in milliseconds, at least b / r
--   shadow          1 if the bucket only observes (never blocks, charged on its own), else 0
--
-- Returns an array of integers:
--   [1] allowed     1 if every enforced bucket held its need (and all of them were charged)
--   [2] now         the microseconds this check used (TIME, or ARGV[1])
--   [1 + 2i]        tokens_i: units left in bucket i after the check
--   [2 + 2i]        wait_i: microseconds until bucket i could pay its need; 0 when it can now,
--                   -1 when it never can (need above capacity)
-- With no KEYS the script touches nothing and returns {1, now}: the start-up probe that the
-- store lets a script read TIME.
--
-- Each bucket is one string of 18 bytes, struct '<I7I7I4': tokens (units), ts (microseconds),
-- scale (the units per token the tokens are counted in, so a changed rule can convert them).
-- It is written back on every call, allowed or refused, with SET ... PX ttl.
--
-- Numbers are Lua 5.1 doubles. Rule validation keeps every integer here below 2^53, where
-- doubles are exact for +, - and *, but `/` rounds: every integer division goes through
-- math.fmod, which is exact, so the quotient's division has an exact result.

-- Redis before 5 replicates scripts verbatim unless told otherwise; TIME needs effects.
if redis.replicate_commands then
  redis.replicate_commands()
end

local fmod, floor = math.fmod, math.floor
local pack, unpack = struct.pack, struct.unpack
local STATE = '<I7I7I4'

local n = #KEYS
if #ARGV ~= 1 + 6 * n then
  return redis.error_reply('check.lua: expected ' .. (1 + 6 * n) .. ' ARGV for ' .. n .. ' keys, got ' .. #ARGV)
end

local now = tonumber(ARGV[1])
if now == nil then
  return redis.error_reply('check.lua: ARGV[1] must be -1 or microseconds')
end
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
if n == 0 then
  return { 1, now }
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

local allowed = true
local tokens, waits, sufficient = {}, {}, {}
for i = 1, n do
  local a = 1 + 6 * (i - 1)
  local scale = tonumber(ARGV[a + 1])
  local refill = tonumber(ARGV[a + 2])
  local cap = tonumber(ARGV[a + 3])
  local need = tonumber(ARGV[a + 4])

  -- bucket.rs `refill`: a missing bucket starts full; a stored one is converted to this rule's
  -- scale, clamped to its capacity, then refilled for the time since ts (never negative).
  local t = cap
  local stored = redis.call('GET', KEYS[i])
  if stored then
    if #stored ~= 18 then
      return redis.error_reply('check.lua: ' .. KEYS[i] .. ' does not hold an 18-byte bucket')
    end
    local s_tokens, s_ts, s_scale = unpack(STATE, stored)
    t = rescale(s_tokens, s_scale, scale)
    if t >= cap then
      t = cap
    else
      local elapsed = now - s_ts
      if elapsed < 0 then
        elapsed = 0
      end
      local room = cap - t
      if elapsed >= div_ceil(room, refill) then
        t = cap
      else
        t = t + elapsed * refill
      end
    end
  end

  -- bucket.rs `wait_us`.
  local w
  if need > cap then
    w = -1
  elseif t >= need then
    w = 0
  else
    w = div_ceil(need - t, refill)
  end
  tokens[i], waits[i], sufficient[i] = t, w, (w == 0)
  if w ~= 0 and ARGV[a + 6] ~= '1' then
    allowed = false
  end
end

-- bucket.rs `check_all`, second pass: enforced buckets are charged only together, shadow ones
-- on their own; every bucket is written back either way.
local out = { allowed and 1 or 0, now }
for i = 1, n do
  local a = 1 + 6 * (i - 1)
  local shadow = ARGV[a + 6] == '1'
  local t = tokens[i]
  if sufficient[i] and (allowed or shadow) then
    t = t - tonumber(ARGV[a + 4])
  end
  redis.call('SET', KEYS[i], pack(STATE, t, now, tonumber(ARGV[a + 1])), 'PX', ARGV[a + 5])
  out[1 + 2 * i] = t
  out[2 + 2 * i] = waits[i]
end
return out
