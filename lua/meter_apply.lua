-- lua/meter_apply.lua: one gateway record added into the meter's ledger as one atomic step, so
-- any number of `tollgate meter` consumers can work through the same stream at once, and a
-- record applied twice (redelivered, replayed, read by a second consumer) changes nothing.
-- src/meter/ledger_redis.rs sends it; tests/meter.rs holds it to that.
--
-- A usage record carries the identity's running total for one key, never a count since its last
-- record: only a total above the largest one kept for (identity, key) adds anything, and what it
-- adds is the difference, to the day and the month the consumer placed the record in.
--
-- KEYS, every record:
--   [1]  zset tollgate:meter:live       identity -> ms of its newest record (not ended, not reported)
--   [2]  hash tollgate:meter:seq        identity -> highest seq applied
--   [3]  set  tollgate:meter:ended      identities that sent `end`
--   [4]  set  tollgate:meter:unclean    identities reported as ended without `end`
-- KEYS, usage records only:
--   [5]  hash tollgate:meter:max:<identity>          key -> largest total applied
--   [6]  hash tollgate:meter:usage:day:<label>       key -> admitted that day (the key's zone)
--   [7]  hash tollgate:meter:usage:month:<label>     key -> admitted that month
--   [8]  set  tollgate:meter:ids:day:<label>:<key>   identities that added to that day
--   [9]  set  tollgate:meter:ids:month:<label>:<key>
--   [10] hash tollgate:meter:key-last                key -> ms of its newest record
-- ARGV:
--   [1]  "usage" or "end"
--   [2]  the identity, as the consumer encodes it
--   [3]  seq, from 1 per identity
--   [4]  ms: the stream entry's time, on the store's clock
--   [5]  key (usage)
--   [6]  total (usage), below 2^53 so that a Lua number holds it exactly
--
-- Returns {added, liveness}: what the record added (0 for a repeat, an older total or an end),
-- and 1 when an identity reported unclean is heard from with a newer record (it had only been
-- idle), 2 when such an identity ends cleanly after all, else 0.

local id = ARGV[2]
local seq = tonumber(ARGV[3])
local ms = tonumber(ARGV[4])
local liveness = 0

-- Only a record newer than any applied (by seq, which the identity counts up) says anything
-- about whether the identity is alive: a replayed old record must not revive one reported
-- unclean, nor move its newest time back.
local newest = tonumber(redis.call('HGET', KEYS[2], id) or '0')
if seq > newest then
  redis.call('HSET', KEYS[2], id, ARGV[3])
end
if redis.call('SISMEMBER', KEYS[3], id) == 0 then
  if ARGV[1] == 'end' then
    redis.call('SADD', KEYS[3], id)
    redis.call('ZREM', KEYS[1], id)
    if redis.call('SREM', KEYS[4], id) == 1 then
      liveness = 2
    end
  elseif seq > newest then
    if redis.call('SREM', KEYS[4], id) == 1 then
      liveness = 1
    end
    local last = redis.call('ZSCORE', KEYS[1], id)
    if not last or tonumber(last) < ms then
      redis.call('ZADD', KEYS[1], ms, id)
    end
  end
end

local added = 0
if ARGV[1] == 'usage' then
  local key = ARGV[5]
  local total = tonumber(ARGV[6])
  local kept = tonumber(redis.call('HGET', KEYS[5], key) or '0')
  if total > kept then
    added = total - kept
    -- '%.0f': a plain integer string; Lua's own number format would write 1e+15.
    local by = string.format('%.0f', added)
    redis.call('HSET', KEYS[5], key, ARGV[6])
    redis.call('HINCRBY', KEYS[6], key, by)
    redis.call('HINCRBY', KEYS[7], key, by)
    redis.call('SADD', KEYS[8], id)
    redis.call('SADD', KEYS[9], id)
  end
  local key_last = tonumber(redis.call('HGET', KEYS[10], key) or '-1')
  if ms > key_last then
    redis.call('HSET', KEYS[10], key, ARGV[4])
  end
end
return {added, liveness}
