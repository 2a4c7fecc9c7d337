-- Takes one seat of a limit on requests in flight, or says how many are taken.
-- KEYS[1]: the limit's sorted set for one key; members are seats, scored by when their lease
--          ends (the store's clock, in ms), so a seat a dead gateway never gave back expires.
-- ARGV[1]: the most seats; ARGV[2]: the seat's name; ARGV[3]: its lease in ms.
-- Returns {1, seats taken now} or {0, seats taken now}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local max = tonumber(ARGV[1])
local lease = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local taken = redis.call('ZCARD', KEYS[1])
if taken >= max then
  return {0, taken}
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[2])
-- The set outlives its longest lease by one more, then goes with the key.
redis.call('PEXPIRE', KEYS[1], lease * 2)
return {1, taken + 1}
