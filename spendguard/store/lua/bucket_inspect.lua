-- One bucket's usage now (expired holds and stale slices are dropped on the way).
-- KEYS: holds, expiry, then one slices hash per window. ARGV: now_ms, then per window: slice_ms.
-- Reply: {held tokens, held cost, then tokens, cost per window}.
local now = arg_int(ARGV[1])
if type(now) == 'table' then return now end
local held_t, held_c = prune(KEYS[1], KEYS[2], now)
local reply = {int(held_t), int(held_c)}
for w = 1, #KEYS - 2 do
  local t, c = window_totals(KEYS[w + 2], tonumber(ARGV[w + 1]), now)
  reply[#reply + 1] = int(t)
  reply[#reply + 1] = int(c)
end
return reply
