-- Fill after a miss (design.md, "Cache misses"): write only keys that are absent, never overwrite.
--
-- KEYS[1]    the team's policy hash
-- KEYS[1+i]  usage hash i
-- ARGV[1]    policy TTL in ms, or "-" to leave the policy hash alone
-- ARGV[2]    n = number of policy fields, then n (field, limit) pairs
-- then, per usage key: settled micro-USD, limit ("-", or a balance key's topped-up total),
-- expiry as epoch ms (period end + grace)
--
-- Every value is validated before the first write (Lua has no rollback). A usage key whose
-- expiry has passed (a closed period) is never recreated.
local function is_uint(v)
  return type(v) == 'string' and #v > 0 and #v <= 18 and string.match(v, '^%d+$') ~= nil
end
local ttl = ARGV[1]
local n = tonumber(ARGV[2])
if (ttl ~= '-' and not is_uint(ttl)) or n == nil or n < 0 then
  return redis.error_reply('spendguard fill: bad header')
end
local first_usage = 3 + 2 * n
if #ARGV ~= first_usage - 1 + 3 * (#KEYS - 1) then
  return redis.error_reply('spendguard fill: argument count')
end
for i = 3, first_usage - 1, 2 do
  local field = ARGV[i]
  if string.sub(field, 1, 6) == 'allow:' then
    -- A model list: newline-separated globs, not an amount.
    if #ARGV[i + 1] == 0 or #ARGV[i + 1] > 65536 then
      return redis.error_reply('spendguard fill: bad model list')
    end
  elseif string.sub(field, 1, 5) == 'rate:' then
    -- A subject's rates: "rpm tpm max_parallel".
    if not string.match(ARGV[i + 1], '^%d+ %d+ %d+$') then
      return redis.error_reply('spendguard fill: bad rates')
    end
  elseif string.sub(field, 1, 2) == 'a:' then
    -- A limit's own alert thresholds: "50,80,100", or "" for none.
    if #ARGV[i + 1] > 256 or not string.match(ARGV[i + 1], '^[%d,]*$') then
      return redis.error_reply('spendguard fill: bad alert thresholds')
    end
  elseif (field ~= 'balance' and string.find(field, ':', 1, true) == nil)
      or not is_uint(ARGV[i + 1]) then
    return redis.error_reply('spendguard fill: bad policy field')
  end
end
for i = first_usage, #ARGV, 3 do
  if not is_uint(ARGV[i]) or not (ARGV[i + 1] == '-' or is_uint(ARGV[i + 1]))
      or not is_uint(ARGV[i + 2]) then
    return redis.error_reply('spendguard fill: bad usage value')
  end
end

if ttl ~= '-' and redis.call('EXISTS', KEYS[1]) == 0 then
  local fields = {'_loaded', '1'}
  for i = 3, first_usage - 1 do
    fields[#fields + 1] = ARGV[i]
  end
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('PEXPIRE', KEYS[1], ttl)
end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
for k = 2, #KEYS do
  local at = first_usage + 3 * (k - 2)
  local settled, limit, expire_at = ARGV[at], ARGV[at + 1], ARGV[at + 2]
  if tonumber(expire_at) > now_ms and redis.call('EXISTS', KEYS[k]) == 0 then
    redis.call('HSET', KEYS[k], 's', settled, 'p', '0')
    if limit ~= '-' then
      redis.call('HSET', KEYS[k], 't', limit)
    end
    redis.call('PEXPIREAT', KEYS[k], expire_at)
  end
end
return 1
