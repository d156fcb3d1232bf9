-- Seed a bucket Redis lost with usage rebuilt from the ledger, unless another replica did.
-- KEYS: holds, then one slices hash per window.
-- ARGV: ttl_ms, then per window: n, then n times: slice index, tokens, cost, requests.
-- Reply: 1 if seeded now, 0 if it already was (nothing written then).
if redis.call('HEXISTS', KEYS[1], '_seeded') == 1 then return 0 end
local ttl = arg_int(ARGV[1])
if type(ttl) == 'table' then return ttl end
local pos = 2
for w = 1, #KEYS - 1 do
  -- Replace, never add to, whatever survived of the window: the ledger has all of it.
  redis.call('DEL', KEYS[w + 1])
  local n = tonumber(ARGV[pos])
  pos = pos + 1
  for _ = 1, n do
    local idx, t, c, r = ARGV[pos], tonumber(ARGV[pos + 1]), tonumber(ARGV[pos + 2]),
      tonumber(ARGV[pos + 3])
    pos = pos + 4
    add_usage(KEYS[w + 1], tonumber(idx), t or 0, c or 0, r or 0)
  end
end
redis.call('HSET', KEYS[1], '_seeded', '1')
renew(KEYS, ttl)
return 1
