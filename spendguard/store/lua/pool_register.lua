-- Register: set a provider key's provider and capacity, keeping its counters and cooldown
-- (every replica registers its keys at start; that must never reset a window).
--
-- KEYS[1]  the key's hash
-- ARGV[1]  provider name
-- ARGV[2]  requests per minute, or "-": unlimited
-- ARGV[3]  tokens per minute, or "-": unlimited
local provider, rpm, tpm = ARGV[1], ARGV[2], ARGV[3]
if type(provider) ~= 'string' or #provider == 0 then
  return redis.error_reply('spendguard pool register: bad provider')
end
for _, v in ipairs({rpm, tpm}) do
  if v ~= '-' and (#v == 0 or #v > 13 or not string.match(v, '^%d+$')) then
    return redis.error_reply('spendguard pool register: bad capacity')
  end
end
redis.call('HSET', KEYS[1], 'p', provider)
if rpm == '-' then redis.call('HDEL', KEYS[1], 'rpm') else redis.call('HSET', KEYS[1], 'rpm', rpm) end
if tpm == '-' then redis.call('HDEL', KEYS[1], 'tpm') else redis.call('HSET', KEYS[1], 'tpm', tpm) end
return 1
