-- Settlement's cache refresh (design.md, "Settlement" and "Invariants" 1 and 4) for one team's usage keys.
--
-- KEYS[k]  usage hash k (absent keys stay absent: the next preflight loads them)
-- ARGV     per key, in KEYS order: settled, limit ("-", or a balance key's topped-up total),
--          a, u, then a record ids whose postflight was applied, then u record ids whose
--          postflight outcome was unknown
--
-- For every settled record, remove its marker and subtract the estimate the marker holds, then
-- raise the settled part to the ledger's aggregate. Aggregates only grow, so a refresh that
-- arrives late (another worker's, from an older read) never lowers it. Running it twice
-- subtracts nothing twice. A record whose postflight outcome was unknown gets a tombstone where
-- it has no marker, so a postflight landing after this refresh cannot leave its estimate behind.
local function is_uint(v)
  return type(v) == 'string' and #v > 0 and #v <= 18 and string.match(v, '^%d+$') ~= nil
end
-- Validate the whole layout before the first write (Lua has no rollback).
local function raise_to(key, field, value)
  local current = redis.call('HGET', key, field)
  -- Compare as decimal strings of equal length: exact beyond 2^53, unlike tonumber.
  if not current or #value > #current or (#value == #current and value > current) then
    redis.call('HSET', key, field, value)
  end
end
local pos = 1
for k = 1, #KEYS do
  local settled, limit, a, u = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], ARGV[pos + 3]
  if not (is_uint(settled) and (limit == '-' or is_uint(limit)) and is_uint(a) and is_uint(u)) then
    return redis.error_reply('spendguard refresh: bad entry header')
  end
  pos = pos + 4 + tonumber(a) + tonumber(u)
end
if pos ~= #ARGV + 1 then
  return redis.error_reply('spendguard refresh: argument count')
end

pos = 1
for k = 1, #KEYS do
  local key = KEYS[k]
  local settled, limit = ARGV[pos], ARGV[pos + 1]
  local a, u = tonumber(ARGV[pos + 2]), tonumber(ARGV[pos + 3])
  local first = pos + 4
  pos = first + a + u
  if redis.call('EXISTS', key) == 1 then
    for i = first, first + a + u - 1 do
      -- A hard limit's hold outlives no settled record (a postflight that never came).
      local hold = redis.call('HGET', key, 'h:' .. ARGV[i])
      if hold then
        redis.call('HDEL', key, 'h:' .. ARGV[i])
        redis.call('HINCRBY', key, 'p', '-' .. hold)
      end
      local marker = 'r:' .. ARGV[i]
      local estimate = redis.call('HGET', key, marker)
      if estimate then
        redis.call('HDEL', key, marker)
        redis.call('HINCRBY', key, 'p', '-' .. estimate)
      elseif i >= first + a then
        redis.call('HSET', key, 'd:' .. ARGV[i], '1')
      end
    end
    raise_to(key, 's', settled)
    if limit ~= '-' then
      raise_to(key, 't', limit)
    end
  end
end
return 1
