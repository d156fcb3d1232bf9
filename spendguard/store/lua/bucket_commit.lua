-- Replace a hold by the actual usage (and one request), counted in the slice of the request's
-- start.
-- KEYS: holds, then one slices hash per window; then (alerting) the bucket's pending alerts
--       hash.
-- ARGV: now_ms, hold id, at_ms, tokens, cost, ttl_ms, then per window: slice_ms and its oldest
--       slice ('' for a rolling window: see bounds); then
--       (alerting) "alerts", then per window its thresholds: "" or
--       "<window id> <epoch> <u><percent>:<limit>:<amount> ..." (u: t tokens, c micro-USD, r
--       requests;
--       epoch: now // the window's length).
-- A hold id written "!<id>" counts the usage only if that hold is still there: recovery of a
-- dead gateway's admission (design.md, "The hold model"), so that the same admission
-- recovered twice, or recovered after its own commit ran, is counted once.
-- Reply: 1 if the hold was still there, 0 if it had expired (the usage is counted either way,
--        but for "!"); alerting, {that, how many alerts fired}.
--
-- Threshold alerts (design.md, "Threshold alerts"): after counting, a window whose committed
-- usage reached an amount fires it once per epoch: the mark _a<u><percent>:<limit> in the
-- window's hash holds the epoch it last fired in (a field starting with _ is not a slice),
-- and the alert waits in the pending hash, in this bucket's slot, until a gateway moves it.
local nw = #KEYS - 1
-- Alerting, the last key is the pending hash and "alerts" follows the windows' arguments.
local alerting = ARGV[7 + 2 * (nw - 1)] == 'alerts'
if alerting then
  nw = nw - 1
  if #ARGV ~= 7 + 3 * nw then
    return redis.error_reply('spendguard budgets: bad alert arguments')
  end
elseif #ARGV ~= 6 + 2 * nw then
  return redis.error_reply('spendguard budgets: bad commit arguments')
end
local now = arg_int(ARGV[1])
local at = arg_int(ARGV[3])
local tokens = arg_int(ARGV[4])
local cost = arg_int(ARGV[5])
local ttl = arg_int(ARGV[6])
for _, v in ipairs({now, at, tokens, cost, ttl}) do
  if type(v) == 'table' then return v end
end
local hold, held_only = ARGV[2], false
if string.sub(hold, 1, 1) == '!' then hold, held_only = string.sub(hold, 2), true end
local own = {}
for i = 1, nw + 1 do own[i] = KEYS[i] end
local found = drop_hold(KEYS[1], hold, now, ttl, own)
if held_only and not found then
  if alerting then return {0, 0} end
  return 0
end
for w = 1, nw do
  local slice_ms = tonumber(ARGV[5 + 2 * w])
  local idx = math.floor(at / slice_ms)
  if idx >= bounds(slice_ms, now, ARGV[6 + 2 * w]) then
    local key = KEYS[w + 1]
    if add_usage(key, idx, tokens, cost, 1) then renew({key}, ttl) end
  end
end
local reply = found and 1 or 0
if not alerting then return reply end
local fired, clock, pending = 0, nil, KEYS[#KEYS]
for w = 1, nw do
  local wid, epoch, marks = string.match(ARGV[7 + 2 * nw + w], '^(%S+) (%d+) (.*)$')
  if wid then
    local key = KEYS[w + 1]
    local t, c, r = window_totals(key, bounds(tonumber(ARGV[5 + 2 * w]), now, ARGV[6 + 2 * w]))
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
return {reply, fired}
