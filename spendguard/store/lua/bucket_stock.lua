-- Stock a gateway's holds ahead of its requests: reserve up to n holds of the same size under
-- ids drawn ahead, as many as every window affords while keeping `share` times what they take
-- free for everyone else (design.md, "Stocked holds"). Each is then exactly a hold that
-- bucket_reserve.lua would have written: one request's, committed, released and recovered by
-- its id.
-- KEYS: holds, then one slices hash per window.
-- ARGV: now_ms, expires_ms, tokens, cost (each hold's), count_cost (1|0), ttl_ms, seeded (1:
--       the bucket must have been seeded), share, then per window the six arguments of
--       bucket_reserve.lua (slice_ms, oldest slice, reset, token, cost and request limits),
--       then the ids, in the order they are to be granted.
-- Reply: how many were granted (the first ones), or -1 when the bucket is not seeded.
local now = arg_int(ARGV[1])
local expires = arg_int(ARGV[2])
local tokens = arg_int(ARGV[3])
local cost = arg_int(ARGV[4])
local count_cost = ARGV[5] == '1'
local ttl = arg_int(ARGV[6])
local share = arg_int(ARGV[8])
for _, v in ipairs({now, expires, tokens, cost, ttl, share}) do
  if type(v) == 'table' then return v end
end
local nw = #KEYS - 1
local first_id = 9 + 6 * nw
local n = #ARGV - first_id + 1
if n < 1 then return 0 end
local hd = header(KEYS[1])
if ARGV[7] == '1' and not hd.seeded then
  return -1
end
prune(KEYS[1], now, hd)

-- At most m such that what is free now, less m holds, keeps share * m holds free.
local m = n
local function fit(free, amount)
  if amount > 0 then
    local most = math.floor(math.max(0, free) / (amount * (share + 1)))
    if most < m then m = most end
  end
end
for w = 1, nw do
  local base = 8 + (w - 1) * 6
  local lo = bounds(tonumber(ARGV[base + 1]), now, ARGV[base + 2], ARGV[base + 3])
  local t, c, r = window_totals(KEYS[w + 1], lo)
  local lim_t, lim_c, lim_r = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5]),
    tonumber(ARGV[base + 6])
  if lim_t then fit(lim_t - t - hd.t, tokens) end
  if count_cost and lim_c then fit(lim_c - c - hd.c, cost) end
  if lim_r then fit(lim_r - r - hd.r, 1) end
end
if m < 1 then return 0 end
local out = {}
local value = int(expires) .. ' ' .. int(tokens) .. ' ' .. int(cost)
for i = 0, m - 1 do
  out[#out + 1] = ARGV[first_id + i]
  out[#out + 1] = value
end
local due = renew_due(hd.x, now, ttl)
out[#out + 1] = '_t'
out[#out + 1] = int(hd.t + m * tokens)
out[#out + 1] = '_c'
out[#out + 1] = int(hd.c + m * cost)
out[#out + 1] = '_r'
out[#out + 1] = int(hd.r + m)
out[#out + 1] = '_n'
out[#out + 1] = int(math.min(hd.n or NEVER, expires))
out[#out + 1] = '_x'
out[#out + 1] = int(due and now or hd.x)
redis.call('HSET', KEYS[1], unpack(out))
if due then renew(KEYS, ttl) end
return m
