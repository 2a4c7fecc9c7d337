-- lua/meter_silence.lua: takes the identities that have gone silent out of the live set and
-- into the set of unclean ends, in one atomic step, so that with several `tollgate meter`
-- consumers each silent identity is reported by exactly one of them
-- (src/meter/ledger_redis.rs).
--
-- KEYS[1]  zset tollgate:meter:live     identity -> ms of its newest record
-- KEYS[2]  set  tollgate:meter:unclean
-- ARGV[1]  ms: identities whose newest record is older than this are silent
-- ARGV[2]  the most to take in one call
--
-- Returns {identity, ms, identity, ms, ...}: the identities taken, each with its newest time.

local found = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1], 'WITHSCORES', 'LIMIT', 0,
  tonumber(ARGV[2]))
for i = 1, #found, 2 do
  redis.call('ZREM', KEYS[1], found[i])
  redis.call('SADD', KEYS[2], found[i])
end
return found
