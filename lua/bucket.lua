-- lua/bucket.lua: the bucket arithmetic and encoding that lua/check.lua, lua/lease.lua and
-- lua/refund.lua share. Redis scripts can't load modules, so the gateway puts this file in front
-- of each script when it loads them (src/store/redis/mod.rs); each script's SHA-1 covers both parts.
--
-- It is src/limit/bucket.rs (`rescale`, `refill`) in Lua 5.1 doubles. Rule validation keeps
-- every integer below 2^53, where doubles are exact for +, - and *, but `/` rounds: every
-- integer division goes through math.fmod, which is exact, so the quotient's division has an
-- exact result.
--
-- A bucket is one field of its page, a hash shared by every bucket of one cluster hash slot: the
-- field is the bucket's name (e.g. rl:{k7}:plan), the page's name (rl:page:{N}, N chosen by the
-- gateway so that the page lies in the bucket's slot) comes after the buckets in KEYS. Many
-- buckets then share one key's overhead, and Redis keeps a small page as a listpack. The value
-- is 25 bytes, struct '<I7I7I4I7': tokens (units), ts (microseconds), scale (the units per token
-- the tokens are counted in, so a changed rule can convert them) and the field's expiry, in the
-- call's clock (microseconds), after which it reads as missing, a full bucket, as a key written
-- with PX would be gone. The page's own TTL is only ever raised, to the latest expiry of its
-- fields and a second more, and each write that adds a field deletes a few long-expired ones it
-- finds at random.
--
-- Before pages, a bucket was its own key: an 18-byte string (the first three numbers) under
-- the bucket's name, written with SET ... PX ttl. A bucket without a field is read from there,
-- and the next write moves it into its page and deletes the old key.

-- Redis before 5 replicates scripts verbatim unless told otherwise; TIME needs effects.
if redis.replicate_commands then
  redis.replicate_commands()
end

local fmod, floor = math.fmod, math.floor
local pack, unpack = struct.pack, struct.unpack
local STATE = '<I7I7I4'
local FIELD = '<I7I7I4I7'
-- Expired fields a write that adds a field deletes from its page at most: bounded work per call,
-- and only when the page grows, so rewriting a live bucket costs no sweep. Each new field looks
-- at SWEEP at random, which keeps the stale fields of a page whose buckets come and go to about
-- as many as its live ones.
local SWEEP = 2
-- How long past its expiry a field is kept before a write may delete it, in microseconds. An
-- expired field already reads as a full bucket; deleting it only once it is a minute stale keeps
-- that answer when a gateway clock (`--clock gateway`) steps back by less than a minute.
local SWEEP_AFTER = 60000000
-- Buckets read from the old layout (name -> true), whose keys their write deletes.
local old_keys = {}
-- Pages whose TTL this call has read or set, and that TTL in milliseconds.
local page_ttl = {}

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

-- The stored state of bucket `key` in `page` at now: 18 bytes of STATE, false when it has none
-- (never written, or expired), or a value of another length when the field or the old key holds
-- something these scripts did not write.
local function load(key, page, now)
  local v = redis.call('HGET', page, key)
  if v then
    if #v ~= 25 then
      return v
    end
    if unpack('<I7', v, 19) < now then
      return false
    end
    return string.sub(v, 1, 18)
  end
  v = redis.call('GET', key)
  if v then
    old_keys[key] = true
  end
  return v
end

-- bucket.rs `refill` of a bucket held as numbers: tokens at ts in s_scale units, converted to
-- this rule's scale, clamped to its capacity, then refilled for the time since ts (never
-- negative).
local function refill_numbers(s_tokens, s_ts, s_scale, scale, cap, refill, now)
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

-- bucket.rs `refill` of the value stored at a key: a missing bucket starts full. nil when the
-- key holds a value these scripts did not write.
local function refilled(stored, scale, cap, refill, now)
  if not stored then
    return cap
  end
  if #stored ~= 18 then
    return nil
  end
  local s_tokens, s_ts, s_scale = unpack(STATE, stored)
  return refill_numbers(s_tokens, s_ts, s_scale, scale, cap, refill, now)
end

-- Writes a bucket back: tokens at `ts` (now, or later for a bucket in debt), in `scale` units,
-- expiring `ttl` milliseconds after `ts`: a debt must outlive its repayment, then the bucket's
-- fill time, like any other bucket.
-- How much longer a page lives than the field that last raised its TTL (see `save`).
local PAGE_SLACK_MS = 1000

local function save(key, page, t, ts, scale, ttl, now)
  local px = tonumber(ttl)
  if ts > now then
    px = px + div_ceil(ts - now, 1000)
  end
  local added = redis.call('HSET', page, key, pack(FIELD, t, ts, scale, now + px * 1000))
  -- The field's expiry counts from this script's clock, the page's TTL from the time Redis
  -- took for the command, which a stalled server can put a few milliseconds earlier: a second
  -- more keeps the page alive past every field in it. When raised it is raised a second past
  -- that, so a page that checks keep busy is raised about once a second rather than at every
  -- check, and a page is asked its TTL once per call.
  local want = px + PAGE_SLACK_MS
  local known = page_ttl[page]
  if known == nil or known < want then
    local have = redis.call('PTTL', page)
    if have < want then
      have = want + PAGE_SLACK_MS
      redis.call('PEXPIRE', page, have)
    end
    page_ttl[page] = have
  end
  if old_keys[key] then
    redis.call('DEL', key)
    old_keys[key] = nil
  end
  if added == 0 then
    return
  end
  local seen = redis.call('HRANDFIELD', page, SWEEP, 'WITHVALUES')
  for i = 1, #seen, 2 do
    local v = seen[i + 1]
    if #v == 25 and unpack('<I7', v, 19) + SWEEP_AFTER < now then
      redis.call('HDEL', page, seen[i])
    end
  end
end

-- A bucket's block (a `block_for` limit that refused it): a field of the bucket's page beside
-- the bucket's own, named after it with '!b' appended, in the bucket's encoding with ts the
-- microsecond the block ends and an expiry no earlier. Returns that microsecond, or 0 when the
-- bucket has none.
local function block_until(key, page)
  local v = redis.call('HGET', page, key .. '!b')
  if v and #v == 25 then
    return (unpack('<I7', v, 8))
  end
  return 0
end

local function save_block(key, page, ends, now)
  save(key .. '!b', page, 0, ends, 0, 0, now)
end

-- bucket.rs `owed_us` of a bucket held as numbers.
local function owed_numbers(s_tokens, s_ts, debt, now)
  if debt > 0 and s_tokens == 0 and s_ts > now then
    return s_ts - now
  end
  return 0
end

-- bucket.rs `owed_us`: the microseconds of refill a post-paid bucket (debt > 0) still owes. A
-- bucket in debt is stored empty with its ts in the future, when refill has paid it back.
local function owed(stored, debt, now)
  if debt <= 0 or not stored or #stored ~= 18 then
    return 0
  end
  local s_tokens, s_ts = unpack(STATE, stored)
  return owed_numbers(s_tokens, s_ts, debt, now)
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

