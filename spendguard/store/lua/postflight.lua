-- Postflight (design.md, "Invariants" 1, 2 and 5): add one record's estimate to the usage keys that exist, once.
--
-- KEYS[i]  a usage hash the preflight found policy-bearing
-- then ARGV[3] rate hashes in which the preflight left the record in flight
-- KEYS[#KEYS]  (with ARGV[5]) the team's admission entries
-- ARGV[1]  record id
-- ARGV[2]  estimate in micro-USD (decimal string), or "-": not charged (holds released only)
-- ARGV[3]  how many rate hashes follow the usage hashes
-- ARGV[4]  the tokens the inference used, or "-": not charged (a TPM reservation is released)
-- ARGV[5]  the minute (epoch ms // 60000) the admission counted the request in, when a check
--          in another slot refused it after all ("-": none): that count is taken back
-- ARGV[6]  (optional) the record, to replace its admission entry with ("" removes the entry:
--          an inference that is not charged; "-" with alerts: no entry)
-- ARGV[6+i] (optional, threshold alerts) for usage key i: "<limit> <percent>:<amount> ..." or
--          "": KEYS[#KEYS] (before the entries key) is then the team's pending alerts hash
--
-- In each rate hash (design.md, "Rates") the record's in-flight entry goes, and a TPM rate's
-- reservation is trued up to what was used, in the minute it was reserved in (while that minute
-- still counts; never below 0). An entry already gone (expired, or a re-sent call) changes
-- nothing.
--
-- Everything is validated before the first write. A missing key is not created from 0 (the
-- next preflight reloads it from the ledger). Per key the record leaves a marker r:<id> holding
-- its estimate, next to the running pending total p: the marker makes a re-sent postflight a
-- no-op and lets settlement subtract exactly this estimate later. A tombstone d:<id> means
-- settlement already handled the record: a postflight arriving that late adds nothing.
local rid, amount, nrates, used, closed = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[6]
local withdrawn = ARGV[5] ~= '-' and tonumber(ARGV[5]) or nil
local alerting = #ARGV > 6
if closed == '-' and alerting then
  closed = nil
end
local nkeys = #KEYS
if closed then
  nkeys = nkeys - 1
end
if alerting then
  nkeys = nkeys - 1
end
if nrates == nil or nrates > nkeys or (used ~= '-' and not tonumber(used))
    or (ARGV[5] ~= '-' and not withdrawn) then
  return redis.error_reply('spendguard postflight: bad rate arguments')
end
nkeys = nkeys - nrates

if type(rid) ~= 'string' or #rid == 0 or #rid > 64 or string.find(rid, '[^%w%-_]') then
  return redis.error_reply('spendguard postflight: bad record id')
end
if amount ~= '-' and (type(amount) ~= 'string' or #amount == 0 or #amount > 18
    or not string.match(amount, '^%d+$')) then
  return redis.error_reply('spendguard postflight: bad amount')
end
-- One read per key, all before the first write (a key that is not a hash fails here): its
-- hold, its tombstone, this record's marker and its settled part (every usage key has one; a
-- key without it is absent).
local marker, tomb, held = 'r:' .. rid, 'd:' .. rid, 'h:' .. rid
local seen = {}
for i = 1, nkeys do
  local got = redis.pcall('HMGET', KEYS[i], held, tomb, marker, 's')
  if got.err then
    return redis.error_reply('spendguard postflight: not a usage key')
  end
  seen[i] = got
end
for i = nkeys + 1, nkeys + nrates do
  local key, slot = KEYS[i], 'f:' .. rid
  local got = redis.call('HMGET', key, slot, 'm', 't', 'pt', 'n', 'r', 'pr')
  if withdrawn then
    local m = tonumber(got[2])
    if m == withdrawn and (tonumber(got[6]) or 0) > 0 then
      redis.call('HSET', key, 'r', tonumber(got[6]) - 1)
    elseif m == withdrawn + 1 and (tonumber(got[7]) or 0) > 0 then
      redis.call('HSET', key, 'pr', tonumber(got[7]) - 1)
    end
  end
  if got[1] then
    redis.call('HDEL', key, slot)
    if (tonumber(got[5]) or 1) <= 1 then
      redis.call('HDEL', key, 'n', 'e')
    else
      redis.call('HSET', key, 'n', tonumber(got[5]) - 1)
    end
    local minute, reserved = string.match(got[1], '^%d+ (%d+) (%S+)$')
    if reserved ~= '-' then
      local delta = (used == '-' and 0 or tonumber(used)) - tonumber(reserved)
      local m, at = tonumber(got[2]), tonumber(minute)
      local field, v = nil, nil
      if at == m then
        field, v = 't', got[3]
      elseif at == m - 1 then
        field, v = 'pt', got[4]
      end
      if field and delta ~= 0 then
        redis.call('HSET', key, field, math.max(0, (tonumber(v) or 0) + delta))
      end
    end
  end
end
local applied = 0
local handled = {} -- a key named twice is charged once (its reads predate the first write)
for i = 1, nkeys do
  local hold, dead, done, settled = seen[i][1], seen[i][2], seen[i][3], seen[i][4]
  if handled[KEYS[i]] then
    hold, settled = nil, nil
  end
  handled[KEYS[i]] = true
  -- A hard limit's hold is replaced by the actual estimate (or only released).
  if hold then
    redis.call('HDEL', KEYS[i], held)
  end
  local add = amount ~= '-' and settled and not dead and not done
  if add then
    redis.call('HSET', KEYS[i], marker, amount)
    applied = applied + 1
  end
  if hold and add and #hold <= 15 and #amount <= 15 then
    -- Both below 10^15: their difference is exact in a double, one increment does both.
    local delta = tonumber(amount) - tonumber(hold)
    if delta ~= 0 then
      redis.call('HINCRBY', KEYS[i], 'p', string.format('%d', delta))
    end
  else
    if hold then
      redis.call('HINCRBY', KEYS[i], 'p', '-' .. hold)
    end
    if add then
      redis.call('HINCRBY', KEYS[i], 'p', amount)
    end
  end
end
-- The entry now holds the whole record until the ledger has it. An entry already gone was
-- recovered (its gateway looked dead) or written: the record is in the ledger, leave it so.
if closed then
  if closed == '' then
    redis.call('HDEL', KEYS[#KEYS], rid)
  elseif redis.call('HEXISTS', KEYS[#KEYS], rid) == 1 then
    redis.call('HSET', KEYS[#KEYS], rid, closed)
  end
end
if not alerting then
  return applied
end
-- Threshold alerts (design.md, "Threshold alerts"): a usage key at or past an amount fires it
-- once per limit amount; the alert waits in the team's hash until a gateway moves it into the
-- ledger's outbox. A key named twice is looked at once.
local fired, akey, clock = 0, KEYS[closed and #KEYS - 1 or #KEYS], nil
local looked = {}
for i = 1, nkeys do
  local spec = ARGV[6 + i]
  if spec and spec ~= '' and not looked[KEYS[i]] then
    looked[KEYS[i]] = true
    local limit, marks = string.match(spec, '^(%d+) (.*)$')
    local sp = redis.call('HMGET', KEYS[i], 's', 'p')
    if limit and sp[1] then
      local used = tonumber(sp[1]) + (tonumber(sp[2]) or 0)
      local label = string.match(KEYS[i], ':spend:usage:(.+)$')
        or (string.match(KEYS[i], ':spend:balance$') and 'balance') or KEYS[i]
      for pct, at in string.gmatch(marks, '(%d+):(%d+)') do
        if used >= tonumber(at)
            and redis.call('HSETNX', KEYS[i], 'a:' .. pct .. ':' .. limit, '1') == 1 then
          if not clock then
            local t = redis.call('TIME')
            clock = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
          end
          redis.call('HSET', akey, label .. ' ' .. pct .. ' ' .. limit,
            string.format('%d', used) .. ' ' .. clock)
          fired = fired + 1
        end
      end
    end
  end
end
return {applied, fired}
