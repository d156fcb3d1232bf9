-- Acquire: reserve one request and an estimate of tokens in a provider key's current
-- one-minute window, if the key is registered, not cooling down, and both fit.
--
-- KEYS[1]  the key's hash: p (provider), rpm and tpm (absent: unlimited), w (the window the
--          counters belong to), r (requests), t (tokens), cu (cooling until, epoch ms)
-- ARGV[1]  now, epoch ms (the caller's clock)
-- ARGV[2]  tokens to reserve
-- ARGV[3]  window length, ms
--
-- Returns {code, n}: {1, window} granted; {2, until} cooling down until; {3, next window's
-- start} full; {4, 0} the estimate exceeds the key's whole TPM; {0, 0} not registered.
-- The check and the reservation are this one call: concurrent callers, on any replica, can
-- never together reserve more than the key's capacity.
for i = 1, 3 do
  local v = ARGV[i]
  if type(v) ~= 'string' or #v == 0 or #v > 13 or not string.match(v, '^%d+$') then
    return redis.error_reply('spendguard pool acquire: bad argument ' .. i)
  end
end
local now, tokens, span = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local h = redis.call('HMGET', KEYS[1], 'p', 'rpm', 'tpm', 'w', 'r', 't', 'cu')
if not h[1] then
  return {0, 0}
end
local cooling = tonumber(h[7] or '0')
if cooling > now then
  return {2, cooling}
end
local rpm, tpm = tonumber(h[2]), tonumber(h[3])
if tpm and tokens > tpm then
  return {4, 0}
end
local w = math.floor(now / span)
local r, t = 0, 0
if tonumber(h[4]) == w then
  r, t = tonumber(h[5] or '0'), tonumber(h[6] or '0')
end
if (rpm and r + 1 > rpm) or (tpm and t + tokens > tpm) then
  return {3, (w + 1) * span}
end
redis.call('HSET', KEYS[1], 'w', w, 'r', r + 1, 't', t + tokens)
return {1, w}
