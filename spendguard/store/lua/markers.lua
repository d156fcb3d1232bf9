-- The records whose estimates are still pending in some usage keys (one round trip).
--
-- KEYS[i]  a usage (or balance) hash of one team
--
-- Returns a flat list: for each key, the number of markers, then their record ids. Settlement
-- asks the ledger which of them are settled: their estimates go, whoever settled them and
-- however long ago, so no estimate outlives its record's settlement for good.
local out = {}
for i = 1, #KEYS do
  local fields = redis.call('HKEYS', KEYS[i])
  local ids = {}
  for _, f in ipairs(fields) do
    if string.sub(f, 1, 2) == 'r:' then
      ids[#ids + 1] = string.sub(f, 3)
    end
  end
  out[#out + 1] = #ids
  for _, id in ipairs(ids) do
    out[#out + 1] = id
  end
end
return out
