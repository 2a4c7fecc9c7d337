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
-- KEYS              the call's buckets in the order its requests first name them (e.g.
--                   rl:{k7}:plan), then the page of each in the same order (see lua/bucket.lua),
--                   so 2 keys per bucket. A name comes again only under another rule (a reload
--                   between two requests) or past how far the gateway looks back; the script
--                   then reads and writes one state for it. In a cluster all keys of one call
--                   share one hash slot; no name holds a rule version.
-- ARGV[1]           the clock: -1 reads the store's TIME (the default); any other value is the
--                   gateway's now in microseconds (`--clock gateway`, for stores that refuse TIME).
-- ARGV[2]           G, the number of requests in this call.
-- then for each request in turn: n, its number of buckets, and for each of its buckets either
--   a bucket met for the first time in this call, the next of KEYS, as 7 integers, or 8 for a
--   bucket of a limit that blocks (flag 8):
--     scale         units per whole token (at least 1)
--     refill        units added per microsecond
--     capacity      burst x scale, the most units the bucket holds
--     need          units the request costs here (cost x scale; the gateway caps it at
--                   capacity + 1, "more than the bucket can ever hold", keeping every number exact)
--     ttl           key expiry in milliseconds, at least b / r
--     flags         1 if the bucket only observes (shadow: never blocks, charged on its own), plus
--                   2 if the call names it again: its state is then kept here between its checks
--                   and written once, after the last, plus 4 if its limit queues (`"delay"`): a
--                   request short of tokens is admitted to wait for them when they are due
--                   within debt / refill microseconds, and the bucket owes them meanwhile, plus
--                   8 if its limit blocks (`"block_for"`): see block below
--     debt          units a post-paid limit's bucket may owe (max_debt x scale), or a queueing
--                   limit's (its longest wait in microseconds x refill), else 0. A bucket
--                   in debt is stored empty with its ts ahead, when refill has repaid it; it
--                   admits nothing before then, and a check leaves the debt where it is
--     block         (flag 8 only) microseconds the bucket stays blocked once it refuses a
--                   request. Sent only for those buckets: each ARGV is a string Redis makes and
--                   the script parses, about 1.5 % of a one-bucket call (benches/README.md). The
--                   block is a field of the bucket's page
--                   beside it (see lua/bucket.lua `block_until`); while it lasts the bucket
--                   refuses every request, whatever it holds
--   or a bucket sent earlier in the call with flag 2, again with the same rule, as 2 integers:
--     -e            minus its place in KEYS
--     need          as above
-- The requests of one call are mostly one client's burst on one key: naming its bucket and rule
-- once rather than once a request saves Redis turning five arguments a check into string objects
-- and Lua strings, and the script parsing them (benches/README.md "Row R").
--
-- Returns an array of integers:
--   [1]             now: the microseconds this call used (TIME, or ARGV[1])
--   then for each request g, 1 + 2 n_g values:
--     admitted       1 if every enforced bucket held its need (and all of them were charged),
--                   0 if not, -1 if one of its buckets holds a value this script did not write
--                   (the request then charges and writes nothing)
--     tokens, wait  per bucket: units left after the check (0 while in debt); microseconds until
--                   the bucket could pay its need, 0 when it can now, -1 when it never can (need
--                   above capacity). A queueing bucket pays a wait up to its longest: the request
--                   then waits that long, and the bucket is stored empty until then. A blocked
--                   bucket's wait is -2 - (microseconds until its block ends)
-- With G = 0 (no KEYS) the script touches nothing and returns {now}: the start-up and /readyz
-- probe that the store lets a script read TIME.
--
-- The bucket encoding and arithmetic come from lua/bucket.lua, loaded in front of this script.
-- Every bucket is written back on every check, admitted or limited; one the call names again
-- (flag 2) is read from its page once and written once, after the call's last request: the
-- HGET and HSET of each check were about a third of its script time (benches/README.md "Row R").
-- Later requests read the state the earlier ones left, as they would from the page.

local nkeys = #KEYS / 2
local groups = tonumber(ARGV[2])
if groups == nil or nkeys % 1 ~= 0 then
  return redis.error_reply('check.lua: KEYS must be buckets then their pages, ARGV[2] the number of requests; got '
    .. #ARGV .. ' ARGV for ' .. #KEYS .. ' keys')
end

local now = clock_now(ARGV[1])
if now == nil then
  return redis.error_reply('check.lua: ARGV[1] must be -1 or microseconds')
end

local function bad(what)
  return redis.error_reply('check.lua: ' .. what .. ' (' .. #ARGV .. ' ARGV for ' .. #KEYS .. ' keys)')
end

-- A call of several requests has its layout read through before anything is checked, so a call
-- whose requests and buckets don't add up changes nothing; a call of one request finds out
-- before its one write pass. (A rule that is not numbers is found where it is read; the gateway
-- sends only integers.)
if groups == 0 and (#ARGV ~= 2 or nkeys ~= 0) then
  return bad('a call of no requests names buckets')
elseif groups > 1 then
  local p, sent, flags_at = 3, 0, {}
  for _ = 1, groups do
    local n = tonumber(ARGV[p])
    if n == nil or n < 0 then
      return bad('a request\'s bucket count is missing or negative')
    end
    p = p + 1
    for _ = 1, n do
      local first = tonumber(ARGV[p])
      if first == nil then
        return bad('a bucket is missing or not a number')
      elseif first < 0 then
        local f = flags_at[-first]
        if f ~= true then
          if f == nil or (tonumber(ARGV[f]) or 0) % 4 < 2 then
            return bad('bucket ' .. first .. ' names no bucket before it with flag 2')
          end
          flags_at[-first] = true
        end
        p = p + 2
      else
        sent = sent + 1
        flags_at[sent] = p + 5
        if (tonumber(ARGV[p + 5]) or 0) >= 8 then
          p = p + 8
        else
          p = p + 7
        end
      end
    end
  end
  if sent > nkeys then
    return bad('the requests name more buckets than KEYS holds')
  end
  if p ~= #ARGV + 1 or sent ~= nkeys then
    return bad('ARGV and KEYS do not hold the same buckets')
  end
end

local out = { now }
-- How many buckets have been sent in full so far: the last one's place in KEYS.
local sent = 0
-- Only a call that names a bucket again makes the tables below. `kept` maps each name kept
-- between checks (flag 2) to its state as the page would hold it after the call's checks so far:
-- what its page held (false when nothing, or a value these scripts did not write) until the
-- call's first write, then true with the numbers in k_t, k_ts, k_scale and its page and ttl
-- for the write after the last request; `order` lists those names in the order first written.
-- r_* hold the rules of the buckets with flag 2, so a repeat parses none.
local none = {}
local kept, order = none, none
local k_t, k_ts, k_scale, k_page, k_ttl = none, none, none, none, none
local r_scale, r_refill, r_cap, r_flags, r_debt, r_at = none, none, none, none, none, none
local r_block = none
-- The end of each block this call has read or started, by bucket name (0: none); made by the
-- first blocking limit's bucket.
local blocks = none
-- The current request's buckets between the two passes, 9 values each: e, scale, flags, need,
-- tokens, wait, owed, where the rule is in ARGV and whether it pays. One table, made at its
-- first bucket's size: a call's tables are a good part of a one-check call's time. A request
-- with a blocking limit's bucket also gets `blk`: by bucket, -1 when blocked, else its block's
-- length, which a refusal now starts.
local cur = { 0, 0, 0, 0, 0, 0, 0, 0, false }
local at = 3
for _ = 1, groups do
  local n = tonumber(ARGV[at])
  if n == nil or n < 0 then
    return bad('a request\'s bucket count is missing or negative')
  end
  at = at + 1

  -- bucket.rs `check_all`, first pass: every bucket refilled to now and measured.
  local admitted, corrupt, blk = true, false, nil
  for j = 0, n - 1 do
    local e, need, scale, refill, cap, flags, debt, block, a
    local first = tonumber(ARGV[at])
    if first == nil then
      return bad('a bucket is missing or not a number')
    elseif first < 0 then
      e, need = -first, tonumber(ARGV[at + 1])
      if r_scale[e] == nil then
        return bad('bucket ' .. first .. ' names no bucket before it with flag 2')
      elseif need == nil then
        return bad('the need of bucket ' .. e .. ' is not a number')
      end
      scale, refill, cap, flags, debt, a = r_scale[e], r_refill[e], r_cap[e], r_flags[e], r_debt[e], r_at[e]
      block = r_block[e]
      at = at + 2
    else
      sent = sent + 1
      e, a = sent, at
      scale, refill, cap = first, tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
      need, flags, debt = tonumber(ARGV[at + 3]), tonumber(ARGV[at + 5]), tonumber(ARGV[at + 6])
      block = 0
      if flags ~= nil and flags >= 8 then
        block = tonumber(ARGV[at + 7])
      end
      if e > nkeys then
        return bad('the requests name more buckets than KEYS holds')
      elseif refill == nil or cap == nil or need == nil or flags == nil or debt == nil or block == nil then
        return bad('the rule of bucket ' .. e .. ' is not numbers')
      end
      if flags % 4 >= 2 then
        if kept == none then
          kept, order = {}, {}
          k_t, k_ts, k_scale, k_page, k_ttl = {}, {}, {}, {}, {}
          r_scale, r_refill, r_cap, r_flags, r_debt, r_at = {}, {}, {}, {}, {}, {}
          r_block = {}
        end
        r_scale[e], r_refill[e], r_cap[e], r_flags[e], r_debt[e], r_at[e] = scale, refill, cap, flags, debt, at
        r_block[e] = block
      end
      if flags >= 8 then
        at = at + 8
      else
        at = at + 7
      end
    end

    local key = KEYS[e]
    local stored = kept[key]
    if stored == nil then
      stored = load(key, KEYS[nkeys + e], now)
      if flags % 4 >= 2 then
        kept[key] = stored
      end
    end
    -- bucket.rs `refill` and `owed_us` of what the page holds: a missing bucket starts full.
    local t, o, s_t, s_ts, s_scale = nil, 0, nil, nil, nil
    if stored == true then
      s_t, s_ts, s_scale = k_t[key], k_ts[key], k_scale[key]
    elseif not stored then
      t = cap
    elseif #stored == 18 then
      s_t, s_ts, s_scale = unpack(STATE, stored)
    else
      corrupt, t = true, cap
    end
    if t == nil then
      t = refill_numbers(s_t, s_ts, s_scale, scale, cap, refill, now)
      if debt > 0 then
        o = owed_numbers(s_t, s_ts, debt, now)
      end
    end

    -- bucket.rs `check_blocking`: a block in force refuses whatever the bucket holds; else
    -- `wait_owing_us` and `BucketParams::pays`.
    local w, pays, blocked = nil, false, false
    -- A check of cost 0 charges nothing: no block refuses it.
    if block > 0 and need > 0 then
      if blocks == none then
        blocks = {}
      end
      local ends = blocks[key]
      if ends == nil then
        ends = block_until(key, KEYS[nkeys + e])
        blocks[key] = ends
      end
      if ends > now then
        w, blocked = ends - now, true
      end
      if blk == nil then
        blk = {}
      end
      blk[j] = blocked and -1 or block
    end
    if blocked then
      pays = false
    else
      if need > cap then
        w = -1
      elseif need == 0 or (o == 0 and t >= need) then
        w = 0
      else
        w = o + div_ceil(need - t, refill)
      end
      pays = w == 0 or (flags % 8 >= 4 and w > 0 and w * refill <= debt)
    end
    local c = 9 * j
    cur[c + 1], cur[c + 2], cur[c + 3], cur[c + 4] = e, scale, flags, need
    cur[c + 5], cur[c + 6], cur[c + 7], cur[c + 8], cur[c + 9] = t, w, o, a, pays
    if not pays and flags % 2 == 0 then
      admitted = false
    end
  end
  if groups == 1 and (at ~= #ARGV + 1 or sent ~= nkeys) then
    return bad('ARGV and KEYS do not hold the same buckets')
  end

  if corrupt then
    out[#out + 1] = -1
    for _ = 1, n do
      out[#out + 1] = 0
      out[#out + 1] = 0
    end
  else
    -- Second pass: enforced buckets are charged only together, shadow ones on their own; every
    -- bucket is written back either way. A bucket of a limit that blocks, refusing now and not
    -- blocked already, starts its block.
    out[#out + 1] = admitted and 1 or 0
    if blk ~= nil then
      for j, b in pairs(blk) do
        local c = 9 * j
        if b > 0 and not cur[c + 9] then
          local key = KEYS[cur[c + 1]]
          blocks[key] = now + b
          save_block(key, KEYS[nkeys + cur[c + 1]], now + b, now)
        end
      end
    end
    for j = 0, n - 1 do
      local c = 9 * j
      local e, scale, flags, need = cur[c + 1], cur[c + 2], cur[c + 3], cur[c + 4]
      local t, w, ts, a = cur[c + 5], cur[c + 6], now + cur[c + 7], cur[c + 8]
      if cur[c + 9] and (admitted or flags % 2 == 1) then
        if w == 0 then
          t = t - need
        else
          -- Queued: empty until its tokens are due (bucket.rs `check_all`).
          t, ts = 0, now + w
        end
      end
      local key = KEYS[e]
      -- A name kept earlier in the call stays kept, whatever this entry's flags say.
      if kept[key] ~= nil then
        if kept[key] ~= true then
          kept[key] = true
          order[#order + 1] = key
        end
        k_t[key], k_ts[key], k_scale[key], k_page[key], k_ttl[key] = t, ts, scale, KEYS[nkeys + e], ARGV[a + 4]
      else
        save(key, KEYS[nkeys + e], t, ts, scale, ARGV[a + 4], now)
      end
      out[#out + 1] = t
      if blk ~= nil and blk[j] == -1 then
        out[#out + 1] = -2 - w
      else
        out[#out + 1] = w
      end
    end
  end
end
for _, key in ipairs(order) do
  save(key, k_page[key], k_t[key], k_ts[key], k_scale[key], k_ttl[key], now)
end
return out
