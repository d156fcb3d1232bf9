-- Shared by every budget script (prepended when loaded). One bucket's keys only, one slot.
--   holds:   hash  hold id -> "expires_ms tokens cost"; _t and _c: totals of the live holds,
--                  _r: how many there are (each hold is one request)
--   expiry:  zset  hold id scored by expires_ms
--   window:  hash  t<slice index> -> tokens, c<slice index> -> micro-USD, r<slice index> ->
--                  requests (committed usage); _T, _C and _R: the totals of the slices
--                  present (_R absent: 0), _F: the lowest slice index present (absent: none).
--                  While _F is still in the window the totals are the window's usage, read
--                  without walking its slices.

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

-- Drops the holds that expired by now; returns the totals of the live ones (tokens, cost,
-- requests).
local function prune(holds, expiry, now)
  local h = redis.call('HMGET', holds, '_t', '_c', '_r')
  local t, c, r = tonumber(h[1] or '0'), tonumber(h[2] or '0'), tonumber(h[3] or '0')
  local gone = redis.call('ZRANGEBYSCORE', expiry, '-inf', now)
  if #gone > 0 then
    for _, id in ipairs(gone) do
      local v = redis.call('HGET', holds, id)
      if v then
        local _, ht, hc = string.match(v, '(%d+) (%d+) (%d+)')
        t = t - tonumber(ht)
        c = c - tonumber(hc)
        r = r - 1
        redis.call('HDEL', holds, id)
      end
    end
    redis.call('ZREMRANGEBYSCORE', expiry, '-inf', now)
    if t < 0 then t = 0 end
    if c < 0 then c = 0 end
    if r < 0 then r = 0 end
    redis.call('HSET', holds, '_t', int(t), '_c', int(c), '_r', int(r))
  end
  return t, c, r
end

-- Returns a hold's amounts to the totals; true if the hold was still there.
local function drop_hold(holds, expiry, id)
  local v = redis.call('HGET', holds, id)
  if not v then return false end
  local _, ht, hc = string.match(v, '(%d+) (%d+) (%d+)')
  redis.call('HDEL', holds, id)
  redis.call('ZREM', expiry, id)
  local h = redis.call('HMGET', holds, '_t', '_c', '_r')
  local t = tonumber(h[1] or '0') - tonumber(ht)
  local c = tonumber(h[2] or '0') - tonumber(hc)
  local r = tonumber(h[3] or '0') - 1
  if t < 0 then t = 0 end
  if c < 0 then c = 0 end
  if r < 0 then r = 0 end
  redis.call('HSET', holds, '_t', int(t), '_c', int(c), '_r', int(r))
  return true
end

-- A window's bounds now: the oldest slice index still in it, and when everything in it
-- leaves at once (a calendar window's reset, ms; nil: a rolling window, whose slices leave one
-- by one). The caller sends them for a calendar window ("" for a rolling one).
local function bounds(slice_ms, now, lo, reset)
  local first = tonumber(lo)
  if first == nil then first = math.floor(now / slice_ms) - SLICES + 1 end
  return first, tonumber(reset)
end

-- The window's committed usage now (lo: its oldest slice), per unit and per slice; slices that
-- left it are deleted and the totals rewritten. One pass over the slices: for a denial's retry
-- time, and when a slice has left the window (once per slice period) or the totals are missing.
local function window_usage(key, lo)
  local flat = redis.call('HGETALL', key)
  local t, c, r, first = 0, 0, 0, nil
  local ts, cs, rs = {}, {}, {}
  local stale = {}
  for i = 1, #flat, 2 do
    local f = flat[i]
    local u = string.sub(f, 1, 1)
    if u ~= '_' then
      local idx = tonumber(string.sub(f, 2))
      local v = tonumber(flat[i + 1])
      if idx == nil or idx < lo then
        stale[#stale + 1] = f
      else
        if first == nil or idx < first then first = idx end
        if u == 't' then
          t = t + v
          ts[idx] = v
        elseif u == 'r' then
          r = r + v
          rs[idx] = v
        else
          c = c + v
          cs[idx] = v
        end
      end
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  if #flat > 0 then
    redis.call('HSET', key, '_T', int(t), '_C', int(c), '_R', int(r))
    if first then redis.call('HSET', key, '_F', int(first)) else redis.call('HDEL', key, '_F') end
  end
  return t, c, r, ts, cs, rs
end

-- The window's committed usage now (tokens, cost, requests): its running totals while its
-- oldest slice is still in it, else one pass (window_usage).
local function window_totals(key, lo)
  local h = redis.call('HMGET', key, '_T', '_C', '_F', '_R')
  if h[1] and h[2] then
    if not h[3] or tonumber(h[3]) >= lo then
      -- _R is written with the first request counted after _T: absent, none since.
      return tonumber(h[1]), tonumber(h[2]), tonumber(h[4] or '0')
    end
  elseif redis.call('EXISTS', key) == 0 then
    return 0, 0, 0
  end
  local t, c, r = window_usage(key, lo)
  return t, c, r
end

-- Adds committed usage to slice idx of a window, keeping its totals (a window written before
-- it had totals gets them from its next full pass instead).
local function add_usage(key, idx, tokens, cost, requests)
  local h = redis.call('HMGET', key, '_T', '_F')
  local kept = h[1] ~= false or redis.call('EXISTS', key) == 0
  if tokens > 0 then
    redis.call('HINCRBY', key, 't' .. int(idx), int(tokens))
    if kept then redis.call('HINCRBY', key, '_T', int(tokens)) end
  end
  if cost > 0 then
    redis.call('HINCRBY', key, 'c' .. int(idx), int(cost))
    if kept then redis.call('HINCRBY', key, '_C', int(cost)) end
  end
  if requests > 0 then
    redis.call('HINCRBY', key, 'r' .. int(idx), int(requests))
    if kept then redis.call('HINCRBY', key, '_R', int(requests)) end
  end
  if kept and (tokens > 0 or cost > 0 or requests > 0) then
    if not h[1] then redis.call('HSETNX', key, '_T', '0') redis.call('HSETNX', key, '_C', '0') end
    if not h[2] or idx < tonumber(h[2]) then redis.call('HSET', key, '_F', int(idx)) end
  end
end

-- Milliseconds until enough slices left the window for `wanted` to fit (see store.retry_ms); a
-- calendar window's (reset given): until its reset, when all of it leaves.
local function retry(slices, slice_ms, now, used, wanted, limit, lo, reset)
  if reset then
    if reset - now < 1 then return 1 end
    return reset - now
  end
  local cur = math.floor(now / slice_ms)
  local span = cur - lo + 1
  if wanted > limit then return slice_ms * span end
  local need = used + wanted - limit
  local drained, last = 0, 0
  for idx = lo, cur do
    local v = slices[idx]
    if v and v > 0 then
      drained = drained + v
      last = (idx + span) * slice_ms - now
      if drained >= need then
        if last < 1 then return 1 end
        return last
      end
    end
  end
  if last < 1000 then return 1000 end
  return last
end
