-- One bucket's usage now (expired holds and stale slices are dropped on the way).
-- KEYS: holds, then one slices hash per window. ARGV: now_ms, then per window: slice_ms
-- and its oldest slice ('' for a rolling window: see bounds).
-- Reply: {held tokens, held cost, held requests, then tokens, cost, requests per window}.
local now = arg_int(ARGV[1])
if type(now) == 'table' then return now end
local hd = header(KEYS[1])
prune(KEYS[1], now, hd)
local held_t, held_c, held_r = hd.t, hd.c, hd.r
local reply = {int(held_t), int(held_c), int(held_r)}
for w = 1, #KEYS - 1 do
  local t, c, r = window_totals(KEYS[w + 1], bounds(tonumber(ARGV[2 * w]), now, ARGV[2 * w + 1]))
  reply[#reply + 1] = int(t)
  reply[#reply + 1] = int(c)
  reply[#reply + 1] = int(r)
end
return reply
