-- Settlement's cache refresh (R7.3/R7.4) for one team's usage keys.
--
-- KEYS[i]        usage hash i (absent keys stay absent: the next preflight loads them)
-- ARGV[i]        the ledger's settled aggregate for KEYS[i], i = 1..#KEYS
-- ARGV[#KEYS+1]  m = number of settled record ids whose postflight was applied, then m ids
-- then           ids of settled records whose postflight outcome was unknown
--
-- For every settled record, remove its marker and subtract the estimate the marker holds;
-- then replace the settled part. Running it twice subtracts nothing twice. A record whose
-- postflight outcome was unknown gets a tombstone where it has no marker, so a postflight
-- that lands after this refresh cannot leave its estimate behind for good.
local nkeys = #KEYS
for i = 1, nkeys do
  local v = ARGV[i]
  if type(v) ~= 'string' or #v == 0 or #v > 18 or not string.match(v, '^%d+$') then
    return redis.error_reply('spendguard refresh: bad settled value')
  end
end
local m = tonumber(ARGV[nkeys + 1])
if m == nil or m < 0 or nkeys + 1 + m > #ARGV then
  return redis.error_reply('spendguard refresh: bad record count')
end
for k = 1, nkeys do
  local key = KEYS[k]
  if redis.call('EXISTS', key) == 1 then
    for i = nkeys + 2, #ARGV do
      local marker = 'r:' .. ARGV[i]
      local estimate = redis.call('HGET', key, marker)
      if estimate then
        redis.call('HDEL', key, marker)
        redis.call('HINCRBY', key, 'p', '-' .. estimate)
      elseif i > nkeys + 1 + m then
        redis.call('HSET', key, 'd:' .. ARGV[i], '1')
      end
    end
    redis.call('HSET', key, 's', ARGV[k])
  end
end
return 1
