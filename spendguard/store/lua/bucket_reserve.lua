-- Reserve one admission's estimate in one bucket if every window can afford it.
-- KEYS: holds, then one slices hash per window.
-- ARGV: now_ms, hold id, expires_ms, tokens, cost, count_cost (1|0), ttl_ms, seeded (1: the
--       bucket must have been seeded: rebuilt from the ledger, or found empty there),
--       then per window: slice_ms, its oldest slice and its reset ('' both: a rolling window;
--       see bounds), token limit or '-', cost limit or '-', request limit or '-'.
-- Reply: {1, used tokens per window (this hold included)...} or {0, window, unit, retry_ms,
-- tokens left, cost left} (window 1-based; unit 1 tokens, 2 cost, 3 requests; left: the least
-- any window has left of that unit now, holds counted, -1 without such a limit: what a
-- smaller request could still take), or {-1} when the bucket is not seeded (Redis lost it: a
-- restart, a flush). Denied or unseeded: nothing is reserved. Every hold is one request.
local now = arg_int(ARGV[1])
local id = ARGV[2]
local expires = arg_int(ARGV[3])
local tokens = arg_int(ARGV[4])
local cost = arg_int(ARGV[5])
local count_cost = ARGV[6] == '1'
local ttl = arg_int(ARGV[7])
for _, v in ipairs({now, expires, tokens, cost, ttl}) do
  if type(v) == 'table' then return v end
end
local hd = header(KEYS[1])
if ARGV[8] == '1' and not hd.seeded then
  return {-1}
end
prune(KEYS[1], now, hd)
local held_t, held_c, held_r = hd.t, hd.c, hd.r

-- A denial: the least left in any window, per unit (-1: no limit of that unit).
local function denied(w, unit, wait)
  local lt, lc = -1, -1
  for v = 1, #KEYS - 1 do
    local base = 8 + (v - 1) * 6
    local lo = bounds(tonumber(ARGV[base + 1]), now, ARGV[base + 2], ARGV[base + 3])
    local t, c = window_totals(KEYS[v + 1], lo)
    local lim_t, lim_c = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5])
    if lim_t then
      local left = math.max(0, lim_t - t - held_t)
      if lt < 0 or left < lt then lt = left end
    end
    if count_cost and lim_c then
      local left = math.max(0, lim_c - c - held_c)
      if lc < 0 or left < lc then lc = left end
    end
  end
  return {0, w, unit, wait, int(lt), int(lc)}
end

local used = {}
for w = 1, #KEYS - 1 do
  local base = 8 + (w - 1) * 6
  local slice_ms = tonumber(ARGV[base + 1])
  local lo, reset = bounds(slice_ms, now, ARGV[base + 2], ARGV[base + 3])
  local lim_t = tonumber(ARGV[base + 4])
  local lim_c = tonumber(ARGV[base + 5])
  local lim_r = tonumber(ARGV[base + 6])
  local t, c, r = window_totals(KEYS[w + 1], lo)
  if lim_t and t + held_t + tokens > lim_t then
    local _, _, _, ts = window_usage(KEYS[w + 1], lo)
    return denied(w, 1, retry(ts, slice_ms, now, t + held_t, tokens, lim_t, lo, reset))
  end
  if count_cost and lim_c and c + held_c + cost > lim_c then
    local _, _, _, _, cs = window_usage(KEYS[w + 1], lo)
    return denied(w, 2, retry(cs, slice_ms, now, c + held_c, cost, lim_c, lo, reset))
  end
  if lim_r and r + held_r + 1 > lim_r then
    local _, _, _, _, _, rs = window_usage(KEYS[w + 1], lo)
    return denied(w, 3, retry(rs, slice_ms, now, r + held_r, 1, lim_r, lo, reset))
  end
  used[#used + 1] = int(t + held_t + tokens)
end
local due = renew_due(hd.x, now, ttl)
redis.call('HSET', KEYS[1], id, int(expires) .. ' ' .. int(tokens) .. ' ' .. int(cost),
  '_t', int(held_t + tokens), '_c', int(held_c + cost), '_r', int(held_r + 1),
  '_n', int(math.min(hd.n, expires)), '_x', int(due and now or hd.x))
if due then renew(KEYS, ttl) end
local reply = {1}
for _, u in ipairs(used) do reply[#reply + 1] = u end
return reply
