-- lua/meter_flag.lua: sets one key's quota flag unless the flag already there is newer, so a
-- `tollgate meter` consumer that added up less (it ran a moment before another) never sets a
-- flag back (src/meter/ledger_redis.rs).
--
-- KEYS[1]  hash tollgate:quota:flags    key -> flag JSON (src/meter/flags.rs), read by gateways
-- ARGV[1]  key id
-- ARGV[2]  the new flag, JSON
-- ARGV[3]  its quota ("day" or "month")
-- ARGV[4]  its resets_at_ms
-- ARGV[5]  its used
--
-- Returns 1 when written, 0 when the flag there is of a later period, or of the same period
-- with more used, for the same kind of quota.

local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local ok, flag = pcall(cjson.decode, cur)
  if ok and type(flag) == 'table' and flag.quota == ARGV[3] then
    local resets, used = tonumber(flag.resets_at_ms), tonumber(flag.used)
    local new_resets, new_used = tonumber(ARGV[4]), tonumber(ARGV[5])
    if resets and used and (resets > new_resets or (resets == new_resets and used > new_used)) then
      return 0
    end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
