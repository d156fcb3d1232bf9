-- Replace a hold by the actual usage, counted in the slice of the request's start.
-- KEYS: holds, expiry, then one slices hash per window.
-- ARGV: now_ms, hold id, at_ms, tokens, cost, ttl_ms, then per window: slice_ms.
-- Reply: 1 if the hold was still there, 0 if it had expired (the usage is counted either way).
local now = arg_int(ARGV[1])
local at = arg_int(ARGV[3])
local tokens = arg_int(ARGV[4])
local cost = arg_int(ARGV[5])
local ttl = arg_int(ARGV[6])
for _, v in ipairs({now, at, tokens, cost, ttl}) do
  if type(v) == 'table' then return v end
end
local found = drop_hold(KEYS[1], KEYS[2], ARGV[2])
for w = 1, #KEYS - 2 do
  local slice_ms = tonumber(ARGV[6 + w])
  local idx = math.floor(at / slice_ms)
  if idx >= math.floor(now / slice_ms) - SLICES + 1 then
    local key = KEYS[w + 2]
    add_usage(key, idx, tokens, cost)
    redis.call('PEXPIRE', key, ttl)
  end
end
if found then return 1 end
return 0
