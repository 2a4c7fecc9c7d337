-- lua/keys_put.lua: one managed API key written as one atomic step: the record, a new
-- generation and the key's place in the change log together, so gateways writing at once
-- never lose a change and a gateway that follows the log never misses one.
-- src/keys/redis.rs sends it; its tests run two writers against one server.
--
-- KEYS[1]  hash tollgate:keys           key id -> record JSON (src/keys/record.rs)
-- KEYS[2]  string tollgate:keys:gen     the generation: +1 on every write
-- KEYS[3]  zset tollgate:keys:changes   key id, scored by the generation of its last write
-- ARGV[1]  key id
-- ARGV[2]  record JSON
-- ARGV[3]  "new": only if the id is free (HSETNX); "put": write over what is there
--
-- Returns the write's generation, or 0 when ARGV[3] is "new" and the id is taken.
-- Generations stay below 2^53, so a sorted set's double score holds each exactly.

if ARGV[3] == 'new' then
  if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then
    return 0
  end
elseif ARGV[3] == 'put' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
else
  return redis.error_reply('keys_put.lua: ARGV[3] must be "new" or "put"')
end
local gen = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[3], gen, ARGV[1])
return gen
