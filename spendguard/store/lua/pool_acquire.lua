-- Acquire: reserve one request and an estimate of tokens on the first candidate provider key,
-- in order, that is registered, not cooling down, and has room for both in its current
-- one-minute window. Every candidate's hash is in one slot (the pool's hash tag), so the
-- choice among them and the reservation are one step.
--
-- KEYS[i]  candidate i's hash: p (provider), rpm and tpm (absent: unlimited), w (the window
--          the counters belong to), r (requests), t (tokens), cu (cooling until, epoch ms)
-- ARGV[1]  now, epoch ms (the caller's clock)
-- ARGV[2]  tokens to reserve
-- ARGV[3]  window length, ms
--
-- Returns {1, i, window}: granted on candidate i. Otherwise {0, code_1, n_1, ..., code_k, n_k},
-- one pair per candidate: {2, until} cooling down until; {3, next window's start} full; {4, 0}
-- the estimate exceeds the key's whole TPM; {0, 0} not registered. Concurrent callers, on any
-- replica, can never together reserve more than a key's capacity.
for i = 1, 3 do
  local v = ARGV[i]
  if type(v) ~= 'string' or #v == 0 or #v > 13 or not string.match(v, '^%d+$') then
    return redis.error_reply('spendguard pool acquire: bad argument ' .. i)
  end
end
local now, tokens, span = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local w = math.floor(now / span)
local refused = {0}
for i = 1, #KEYS do
  local h = redis.call('HMGET', KEYS[i], 'p', 'rpm', 'tpm', 'w', 'r', 't', 'cu')
  local code, n = 0, 0
  if h[1] then
    local cooling = tonumber(h[7] or '0')
    local rpm, tpm = tonumber(h[2]), tonumber(h[3])
    local r, t = 0, 0
    if tonumber(h[4]) == w then
      r, t = tonumber(h[5] or '0'), tonumber(h[6] or '0')
    end
    if cooling > now then
      code, n = 2, cooling
    elseif tpm and tokens > tpm then
      code, n = 4, 0
    elseif (rpm and r + 1 > rpm) or (tpm and t + tokens > tpm) then
      code, n = 3, (w + 1) * span
    else
      redis.call('HSET', KEYS[i], 'w', w, 'r', r + 1, 't', t + tokens)
      return {1, i, w}
    end
  end
  refused[#refused + 1] = code
  refused[#refused + 1] = n
end
return refused
