-- Settle or release a lease on a provider key.
--
-- KEYS[1]  the key's hash (see acquire.lua)
-- ARGV[1]  the lease's window
-- ARGV[2]  tokens it reserved
-- ARGV[3]  tokens the call used, or "-": release (the call was not made or was refused)
-- ARGV[4]  now, epoch ms
-- ARGV[5]  window length, ms
--
-- In the lease's window (still the current one): settle replaces the reservation with the
-- actual tokens, release gives back the request and the reservation (never below 0). In a
-- later window the reservation has lapsed with its window: settle adds only the tokens used
-- beyond it to the current window, release does nothing.
for i = 1, 5 do
  local v = ARGV[i]
  if not (i == 3 and v == '-') and (type(v) ~= 'string' or #v == 0 or #v > 13
      or not string.match(v, '^%d+$')) then
    return redis.error_reply('spendguard pool settle: bad argument ' .. i)
  end
end
local lease, reserved, actual = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local w = math.floor(tonumber(ARGV[4]) / tonumber(ARGV[5]))
local h = redis.call('HMGET', KEYS[1], 'p', 'w', 'r', 't')
if not h[1] then
  return 0
end
local stored = tonumber(h[2])
local r, t = tonumber(h[3] or '0'), tonumber(h[4] or '0')
if lease == w and stored == w then
  if actual then
    redis.call('HSET', KEYS[1], 't', math.max(0, t - reserved + actual))
  else
    redis.call('HSET', KEYS[1], 'r', math.max(0, r - 1), 't', math.max(0, t - reserved))
  end
  return 1
end
if actual and actual > reserved then
  if stored ~= w then
    r, t = 0, 0
  end
  redis.call('HSET', KEYS[1], 'w', w, 'r', r, 't', t + actual - reserved)
  return 1
end
return 0
