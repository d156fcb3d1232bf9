-- Settle or release leases on one provider key: one request's (its finish), or several at once
-- (the settlements a gateway carried together, engine/carryover.py), read and written once.
--
-- KEYS[1]  the key's hash (see pool_acquire.lua)
-- ARGV[1]  now, epoch ms
-- ARGV[2]  window length, ms
-- then per lease: its window, the tokens it reserved, and the tokens the call used, or "-":
--          release (the call was not made or was refused)
--
-- Each lease, in turn: in its window (still the current one), settle replaces the reservation
-- with the actual tokens, release gives back the request and the reservation (never below 0).
-- In a later window the reservation has lapsed with its window: settle adds only the tokens
-- used beyond it to the current window, release does nothing. Returns how many changed the
-- key.
local n = (#ARGV - 2) / 3
if #ARGV < 5 or n ~= math.floor(n) then
  return redis.error_reply('spendguard pool settle: argument count')
end
for i = 1, #ARGV do
  local v = ARGV[i]
  local release = i > 2 and (i - 2) % 3 == 0 and v == '-'
  if not release and (type(v) ~= 'string' or #v == 0 or #v > 13
      or not string.match(v, '^%d+$')) then
    return redis.error_reply('spendguard pool settle: bad argument ' .. i)
  end
end
local w = math.floor(tonumber(ARGV[1]) / tonumber(ARGV[2]))
local h = redis.call('HMGET', KEYS[1], 'p', 'w', 'r', 't')
if not h[1] then
  return 0
end
local stored = tonumber(h[2])
local r, t = tonumber(h[3] or '0'), tonumber(h[4] or '0')
local changed = 0
for i = 0, n - 1 do
  local lease, reserved = tonumber(ARGV[3 + 3 * i]), tonumber(ARGV[4 + 3 * i])
  local actual = tonumber(ARGV[5 + 3 * i]) -- nil: a release
  if lease == w and stored == w then
    if actual then
      t = math.max(0, t - reserved + actual)
    else
      r, t = math.max(0, r - 1), math.max(0, t - reserved)
    end
    changed = changed + 1
  elseif actual and actual > reserved then
    if stored ~= w then
      stored, r, t = w, 0, 0
    end
    t = t + actual - reserved
    changed = changed + 1
  end
end
if changed > 0 then
  redis.call('HSET', KEYS[1], 'w', stored, 'r', r, 't', t)
end
return changed
