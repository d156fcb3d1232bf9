-- Cooldown: a provider key is skipped by every replica until the given time. The stored end
-- only moves later: a replica that saw a shorter Retry-After never shortens another's cooldown.
--
-- KEYS[1]  the key's hash (see acquire.lua)
-- ARGV[1]  cooling until, epoch ms
--
-- Returns the cooldown's end after this call, or -1 when the key is not registered.
local v = ARGV[1]
if type(v) ~= 'string' or #v == 0 or #v > 13 or not string.match(v, '^%d+$') then
  return redis.error_reply('spendguard pool cooldown: bad time')
end
local h = redis.call('HMGET', KEYS[1], 'p', 'cu')
if not h[1] then
  return -1
end
local ends = math.max(tonumber(h[2] or '0'), tonumber(v))
redis.call('HSET', KEYS[1], 'cu', ends)
return ends
