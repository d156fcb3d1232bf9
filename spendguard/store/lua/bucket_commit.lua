-- Replace holds by the actual usage (and one request each), counted in the slice of each
-- request's start: one request's (its finish), or several at once (the finishes a gateway
-- carried together, engine/carryover.py), read and written once.
-- KEYS: holds, then one slices hash per window; then (alerting) the bucket's pending alerts
--       hash.
-- ARGV: now_ms, ttl_ms, k, then k times: hold id, at_ms, tokens, cost; then per window:
--       slice_ms and its oldest slice ('' for a rolling window: see bounds); then
--       (alerting) "alerts", then per window its thresholds: "" or
--       "<window id> <epoch> <u><percent>:<limit>:<amount> ..." (u: t tokens, c micro-USD, r
--       requests;
--       epoch: now // the window's length).
-- A hold id written "!<id>" counts the usage only if that hold is still there: recovery of a
-- dead gateway's admission (design.md, "The hold model"), so that the same admission
-- recovered twice, or recovered after its own commit ran, is counted once.
-- Reply: how many of the holds were still there (the usage is counted either way, but for
--        "!"); alerting, {that, how many alerts fired}.
--
-- Threshold alerts (design.md, "Threshold alerts"): after counting, a window whose committed
-- usage reached an amount fires it once per epoch: the mark _a<u><percent>:<limit> in the
-- window's hash holds the epoch it last fired in (a field starting with _ is not a slice),
-- and the alert waits in the pending hash, in this bucket's slot, until a gateway moves it.
local k = tonumber(ARGV[3])
if k == nil or k < 1 or k ~= math.floor(k) then
  return redis.error_reply('spendguard budgets: bad commit arguments')
end
local head = 3 + 4 * k -- the last argument of the holds
local nw = #KEYS - 1
-- Alerting, the last key is the pending hash and "alerts" follows the windows' arguments.
local alerting = ARGV[head + 1 + 2 * (nw - 1)] == 'alerts'
if alerting then
  nw = nw - 1
  if #ARGV ~= head + 1 + 3 * nw then
    return redis.error_reply('spendguard budgets: bad alert arguments')
  end
elseif #ARGV ~= head + 2 * nw then
  return redis.error_reply('spendguard budgets: bad commit arguments')
end
local now = arg_int(ARGV[1])
local ttl = arg_int(ARGV[2])
for _, v in ipairs({now, ttl}) do
  if type(v) == 'table' then return v end
end
local ids, held_only, at, tokens, cost = {}, {}, {}, {}, {}
for i = 1, k do
  local a = 3 + 4 * (i - 1)
  local id = ARGV[a + 1]
  held_only[i] = string.sub(id, 1, 1) == '!'
  ids[i] = held_only[i] and string.sub(id, 2) or id
  at[i], tokens[i], cost[i] = arg_int(ARGV[a + 2]), arg_int(ARGV[a + 3]), arg_int(ARGV[a + 4])
  for _, v in ipairs({at[i], tokens[i], cost[i]}) do
    if type(v) == 'table' then return v end
  end
end
local own = {}
for i = 1, nw + 1 do own[i] = KEYS[i] end
local found = drop_holds(KEYS[1], ids, now, ttl, own)
local there, counted = 0, 0
for i = 1, k do
  if found[i] then there = there + 1 end
  if found[i] or not held_only[i] then counted = counted + 1 end
end
if counted == 0 then
  if alerting then return {0, 0} end
  return 0
end
for w = 1, nw do
  local slice_ms = tonumber(ARGV[head + 2 * w - 1])
  local lo = bounds(slice_ms, now, ARGV[head + 2 * w])
  -- The usage per slice: each slice read and written once (in the order first met).
  local order, sum = {}, {}
  for i = 1, k do
    if found[i] or not held_only[i] then
      local idx = math.floor(at[i] / slice_ms)
      if idx >= lo then
        local s = sum[idx]
        if not s then
          s = {0, 0, 0}
          sum[idx] = s
          order[#order + 1] = idx
        end
        s[1], s[2], s[3] = s[1] + tokens[i], s[2] + cost[i], s[3] + 1
      end
    end
  end
  local key = KEYS[w + 1]
  for _, idx in ipairs(order) do
    local s = sum[idx]
    if add_usage(key, idx, s[1], s[2], s[3]) then renew({key}, ttl) end
  end
end
if not alerting then return there end
local fired, clock, pending = 0, nil, KEYS[#KEYS]
for w = 1, nw do
  local wid, epoch, marks = string.match(ARGV[head + 1 + 2 * nw + w], '^(%S+) (%d+) (.*)$')
  if wid then
    local key = KEYS[w + 1]
    local t, c, r = window_totals(key, bounds(tonumber(ARGV[head + 2 * w - 1]), now, ARGV[head + 2 * w]))
    for u, pct, limit, amount in string.gmatch(marks, '([tcr])(%d+):(%d+):(%d+)') do
      local used = (u == 't' and t) or (u == 'c' and c) or r
      local mark = '_a' .. u .. pct .. ':' .. limit
      if used >= tonumber(amount) and redis.call('HGET', key, mark) ~= epoch then
        redis.call('HSET', key, mark, epoch)
        if not clock then
          local tm = redis.call('TIME')
          clock = tm[1] .. string.format('%03d', math.floor(tonumber(tm[2]) / 1000))
        end
        redis.call('HSET', pending, table.concat({wid, u, pct, limit, epoch}, ' '),
          int(used) .. ' ' .. clock)
        fired = fired + 1
      end
    end
  end
end
return {there, fired}
