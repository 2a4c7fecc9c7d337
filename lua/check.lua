-- lua/check.lua: the token-bucket check of one or more requests, each all-or-nothing over its
-- buckets, run by the store as one atomic step. It is the arithmetic of src/limit/bucket.rs
-- (`rescale`, `refill`, `wait_us`, `check_all`) line for line, so both give the same decisions,
-- the same units left and the same waits; tests/redis_equivalence.rs holds them to it.
--
-- A gateway sends one request per call when the store keeps up, and the requests that queued
-- meanwhile together in one call when it doesn't: one call per request would cost the gateway a
-- socket write and the store a command dispatch per request. The requests of one call are
-- checked one after another, in order, at the same `now`, as if they had arrived in that order
-- within one microsecond.
--
-- KEYS              every bucket of request 1, then of request 2, ..., e.g. rl:{k7}:plan, then the
--                   page of each bucket in the same order (see lua/bucket.lua), so 2 keys per
--                   bucket. In a cluster all keys of one call share one hash slot; no name holds
--                   a rule version.
-- ARGV[1]           the clock: -1 reads the store's TIME (the default); any other value is the
--                   gateway's now in microseconds (`--clock gateway`, for stores that refuse TIME).
-- ARGV[2]           G, the number of requests in this call.
-- ARGV[2 + g]       n_g, the number of buckets of request g (g = 1..G); the n_g add up to #KEYS.
-- ARGV[3 + G + 7(i-1) ... 9 + G + 7(i-1)], the rule of bucket i (KEYS[i]), in integers:
--   scale           units per whole token
--   refill          units added per microsecond
--   capacity        burst x scale, the most units the bucket holds
--   need            units the request costs here (cost x scale; the gateway caps it at
--                   capacity + 1, "more than the bucket can ever hold", keeping every number exact)
--   ttl             key expiry in milliseconds, at least b / r
--   shadow          1 if the bucket only observes (never blocks, charged on its own), else 0
--   debt            units a post-paid limit's bucket may owe (max_debt x scale), else 0. A bucket
--                   in debt is stored empty with its ts ahead, when refill has repaid it; it
--                   admits nothing before then, and a check leaves the debt where it is
--
-- Returns an array of integers:
--   [1]             now: the microseconds this call used (TIME, or ARGV[1])
--   then for each request g, 1 + 2 n_g values:
--     admitted       1 if every enforced bucket held its need (and all of them were charged),
--                   0 if not, -1 if one of its buckets holds a value this script did not write
--                   (the request then charges and writes nothing)
--     tokens, wait  per bucket: units left after the check (0 while in debt); microseconds until
--                   the bucket could pay its need, 0 when it can now, -1 when it never can (need
--                   above capacity)
-- With G = 0 (no KEYS) the script touches nothing and returns {now}: the start-up and /readyz
-- probe that the store lets a script read TIME.
--
-- The bucket encoding and arithmetic come from lua/bucket.lua, loaded in front of this script.
-- Every bucket is written back on every check, admitted or limited. In a call of several
-- requests a bucket is read from its page once and written once, after the last request: the
-- requests of one call are mostly one client's burst on one key, and the HGET and HSET of each
-- check were about a third of its script time (benches/README.md "Row R"). Later requests read
-- the state the earlier ones left, as they would from the page.

local nkeys = #KEYS / 2
local groups = tonumber(ARGV[2])
if groups == nil or nkeys % 1 ~= 0 or #ARGV ~= 2 + groups + 7 * nkeys then
  return redis.error_reply('check.lua: KEYS must be buckets then their pages, ARGV clock, G, G bucket counts and 7 numbers per bucket; got '
    .. #ARGV .. ' ARGV for ' .. #KEYS .. ' keys')
end

local now = clock_now(ARGV[1])
if now == nil then
  return redis.error_reply('check.lua: ARGV[1] must be -1 or microseconds')
end

local out = { now }
local first = 1
-- Buckets named more than once in the call: each one's state after the call's last check of
-- it, as its page would hold it, and what to write back, in the order they were first written.
-- A call of distinct buckets reads and writes as a single request does.
local none = {}
local repeated, kept, writes, order = none, none, none, none
if groups > 1 then
  repeated, kept, writes, order = {}, {}, {}, {}
  local seen = {}
  for i = 1, nkeys do
    local key = KEYS[i]
    if seen[key] then
      repeated[key] = true
    end
    seen[key] = true
  end
end
for g = 1, groups do
  local n = tonumber(ARGV[2 + g])
  local last = first + n - 1
  if n < 0 or last > nkeys then
    return redis.error_reply('check.lua: the bucket counts add up to more than the buckets in KEYS')
  end

  -- bucket.rs `check_all`, first pass: every bucket refilled to now and measured.
  local admitted, corrupt = true, false
  local tokens, waits, oweds = {}, {}, {}
  for i = first, last do
    local a = 2 + groups + 7 * (i - 1)
    local scale = tonumber(ARGV[a + 1])
    local refill = tonumber(ARGV[a + 2])
    local cap = tonumber(ARGV[a + 3])
    local need = tonumber(ARGV[a + 4])

    local stored = kept[KEYS[i]]
    if stored == nil then
      stored = load(KEYS[i], KEYS[nkeys + i], now)
    end
    local t = refilled(stored, scale, cap, refill, now)
    local o = 0
    if t == nil then
      corrupt, t = true, cap
    else
      o = owed(stored, tonumber(ARGV[a + 7]), now)
    end

    -- bucket.rs `wait_owing_us`.
    local w
    if need > cap then
      w = -1
    elseif need == 0 or (o == 0 and t >= need) then
      w = 0
    else
      w = o + div_ceil(need - t, refill)
    end
    tokens[i], waits[i], oweds[i] = t, w, o
    if w ~= 0 and ARGV[a + 6] ~= '1' then
      admitted = false
    end
  end

  if corrupt then
    out[#out + 1] = -1
    for _ = first, last do
      out[#out + 1] = 0
      out[#out + 1] = 0
    end
  else
    -- Second pass: enforced buckets are charged only together, shadow ones on their own; every
    -- bucket is written back either way.
    out[#out + 1] = admitted and 1 or 0
    for i = first, last do
      local a = 2 + groups + 7 * (i - 1)
      local t = tokens[i]
      if waits[i] == 0 and (admitted or ARGV[a + 6] == '1') then
        t = t - tonumber(ARGV[a + 4])
      end
      local key, ts, scale = KEYS[i], now + oweds[i], tonumber(ARGV[a + 1])
      if repeated[key] then
        local w = writes[key]
        if w == nil then
          w = {}
          writes[key] = w
          order[#order + 1] = key
        end
        w[1], w[2], w[3], w[4], w[5] = KEYS[nkeys + i], t, ts, scale, ARGV[a + 5]
        kept[key] = pack(STATE, t, ts, scale)
      else
        save(key, KEYS[nkeys + i], t, ts, scale, ARGV[a + 5], now)
      end
      out[#out + 1] = t
      out[#out + 1] = waits[i]
    end
  end
  first = last + 1
end
if first ~= nkeys + 1 then
  return redis.error_reply('check.lua: the bucket counts add up to less than the buckets in KEYS')
end
for _, key in ipairs(order) do
  local w = writes[key]
  save(key, w[1], w[2], w[3], w[4], w[5], now)
end
return out
