-- Shared by every budget script (prepended when loaded). One bucket's keys only, one slot.
--   holds:   hash  hold id -> "expires_ms tokens cost"; _t and _c: totals of the live holds
--   expiry:  zset  hold id scored by expires_ms
--   window:  hash  t<slice index> -> tokens, c<slice index> -> micro-USD (committed usage)

local SLICES = 60

local function int(x)
  -- Lua numbers are doubles; %d keeps 10^15 from reaching Redis as "1e+15".
  return string.format('%d', x)
end

local function arg_int(s)
  local n = tonumber(s)
  if n == nil or n < 0 or n ~= math.floor(n) or n > 1e17 then
    return redis.error_reply('spendguard budgets: bad integer argument ' .. tostring(s))
  end
  return n
end

-- Drops the holds that expired by now; returns the totals of the live ones.
local function prune(holds, expiry, now)
  local t = tonumber(redis.call('HGET', holds, '_t') or '0')
  local c = tonumber(redis.call('HGET', holds, '_c') or '0')
  local gone = redis.call('ZRANGEBYSCORE', expiry, '-inf', now)
  if #gone > 0 then
    for _, id in ipairs(gone) do
      local v = redis.call('HGET', holds, id)
      if v then
        local _, ht, hc = string.match(v, '(%d+) (%d+) (%d+)')
        t = t - tonumber(ht)
        c = c - tonumber(hc)
        redis.call('HDEL', holds, id)
      end
    end
    redis.call('ZREMRANGEBYSCORE', expiry, '-inf', now)
    if t < 0 then t = 0 end
    if c < 0 then c = 0 end
    redis.call('HSET', holds, '_t', int(t), '_c', int(c))
  end
  return t, c
end

-- Returns a hold's amounts to the totals; true if the hold was still there.
local function drop_hold(holds, expiry, id)
  local v = redis.call('HGET', holds, id)
  if not v then return false end
  local _, ht, hc = string.match(v, '(%d+) (%d+) (%d+)')
  redis.call('HDEL', holds, id)
  redis.call('ZREM', expiry, id)
  local t = tonumber(redis.call('HGET', holds, '_t') or '0') - tonumber(ht)
  local c = tonumber(redis.call('HGET', holds, '_c') or '0') - tonumber(hc)
  if t < 0 then t = 0 end
  if c < 0 then c = 0 end
  redis.call('HSET', holds, '_t', int(t), '_c', int(c))
  return true
end

-- The window's committed usage now, per unit and per slice; slices that left it are deleted.
local function window_usage(key, slice_ms, now)
  local cur = math.floor(now / slice_ms)
  local lo = cur - SLICES + 1
  local flat = redis.call('HGETALL', key)
  local t, c = 0, 0
  local ts, cs = {}, {}
  local stale = {}
  for i = 1, #flat, 2 do
    local f = flat[i]
    local idx = tonumber(string.sub(f, 2))
    local v = tonumber(flat[i + 1])
    if idx == nil or idx < lo then
      stale[#stale + 1] = f
    elseif string.sub(f, 1, 1) == 't' then
      t = t + v
      ts[idx] = v
    else
      c = c + v
      cs[idx] = v
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  return t, c, ts, cs
end

-- Milliseconds until enough slices left the window for `wanted` to fit (see store.retry_ms).
local function retry(slices, slice_ms, now, used, wanted, limit)
  local period = slice_ms * SLICES
  if wanted > limit then return period end
  local need = used + wanted - limit
  local cur = math.floor(now / slice_ms)
  local drained, last = 0, 0
  for idx = cur - SLICES + 1, cur do
    local v = slices[idx]
    if v and v > 0 then
      drained = drained + v
      last = (idx + SLICES) * slice_ms - now
      if drained >= need then
        if last < 1 then return 1 end
        return last
      end
    end
  end
  if last < 1000 then return 1000 end
  return last
end
