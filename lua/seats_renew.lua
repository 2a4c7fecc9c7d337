-- Extends the leases of one limit's seats this gateway still holds for one key: every third of
-- a lease, so a request that outlasts its lease keeps its seat.
-- KEYS[1]: the limit's sorted set for the key; ARGV[1]: the lease in ms; ARGV[2..]: the seats.
-- A seat already gone (expired, or given back) is not brought back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local renewed = 0
for i = 2, #ARGV do
  renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + lease, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], lease * 2)
return renewed
