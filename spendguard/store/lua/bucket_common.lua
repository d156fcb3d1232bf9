-- Shared by every budget script (prepended when loaded). One bucket's keys only, one slot.
--   holds:   hash  hold id -> "expires_ms tokens cost"; _t and _c: totals of the live holds,
--                  _r: how many there are (each hold is one request); _n: no hold expires
--                  before it (absent: unknown), so a reserve looks for expired holds only once
--                  the earliest may have; _x: when the bucket's keys last had their lifetime
--                  renewed (see renew); _seeded: the bucket was rebuilt from the ledger
--   window:  hash  t<slice index> -> tokens, c<slice index> -> micro-USD, r<slice index> ->
--                  requests (committed usage); _T, _C and _R: the totals of the slices
--                  present (_R absent: 0), _F: the lowest slice index present (absent: none).
--                  While _F is still in the window the totals are the window's usage, read
--                  without walking its slices.
--
-- Every redis.call inside a script is a command the server runs (a write one it also sends to
-- its replicas and its AOF), and these scripts run on every admission and every finish: so
-- each reads its hashes with one HMGET and writes them with one HSET, and leaves the rare
-- work (expired holds, lifetimes) to the calls that find it due.

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

-- No hold expires at or after this (ms): the _n of a bucket without holds.
local NEVER = 9007199254740992

-- The bucket's header: one read of the holds hash. Absent fields read as false.
local function header(holds)
  local h = redis.call('HMGET', holds, '_t', '_c', '_r', '_n', '_x', '_seeded')
  return {
    t = tonumber(h[1] or '0'), c = tonumber(h[2] or '0'), r = tonumber(h[3] or '0'),
    n = tonumber(h[4] or ''), x = tonumber(h[5] or ''), seeded = h[6] ~= false,
    exists = h[1] ~= false or h[4] ~= false or h[5] ~= false or h[6] ~= false,
  }
end

-- Drops the holds that expired by now, once the earliest may have (hd.n); updates hd's totals
-- and hd.n (the earliest expiry left). One pass over the holds hash: it is due about once per
-- hold lifetime (_n is lowered by reserves, never raised by commits), so a sorted set of
-- expiries, written by every reserve and commit, would cost more than it saves. (Buckets an
-- earlier release wrote also kept one, "expiry": left to lapse, its holds are in the hash.)
local function prune(holds, now, hd)
  if hd.n and now < hd.n then return end
  local flat = redis.call('HGETALL', holds)
  local gone, first = {}, NEVER
  for i = 1, #flat, 2 do
    local id = flat[i]
    if string.byte(id, 1) ~= 95 then -- a hold, not a header field ('_')
      local e, ht, hc = string.match(flat[i + 1], '(%d+) (%d+) (%d+)')
      e = tonumber(e)
      if e <= now then
        gone[#gone + 1] = id
        hd.t = math.max(0, hd.t - tonumber(ht))
        hd.c = math.max(0, hd.c - tonumber(hc))
        hd.r = math.max(0, hd.r - 1)
      elseif e < first then
        first = e
      end
    end
  end
  if #gone > 0 then redis.call('HDEL', holds, unpack(gone)) end
  local old = hd.n
  hd.n = first
  if #gone > 0 or (hd.exists and hd.n ~= old) then
    redis.call('HSET', holds, '_t', int(hd.t), '_c', int(hd.c), '_r', int(hd.r), '_n', int(hd.n))
  end
end

-- Whether the bucket's keys are due for a longer life: each key lives ttl and a sixteenth
-- more from its last renewal (or its creation: see add_usage), and renewals come at most a
-- sixteenth apart, so whatever a key holds outlives its last write by at least ttl.
local function renew_due(x, now, ttl)
  return x == nil or now - x >= math.floor(ttl / 16) or now < x
end

local function renew(keys, ttl)
  local life = ttl + math.floor(ttl / 16)
  for i = 1, #keys do redis.call('PEXPIRE', keys[i], life) end
end

-- Returns the holds' amounts to the totals and drops them: one read and one write of the
-- holds hash, however many. found[i]: whether ids[i] was there (an id given twice is found
-- once). Renews the bucket's lifetime on the way when due (now given).
local function drop_holds(holds, ids, now, ttl, keys)
  local fields = {'_t', '_c', '_r', '_x'}
  for i = 1, #ids do fields[4 + i] = ids[i] end
  local h = redis.call('HMGET', holds, unpack(fields))
  local due = now and renew_due(tonumber(h[4] or ''), now, ttl)
  local t, c, r = tonumber(h[1] or '0'), tonumber(h[2] or '0'), tonumber(h[3] or '0')
  local found, gone, seen = {}, {}, {}
  for i = 1, #ids do
    local v = h[4 + i]
    if v and not seen[ids[i]] then
      seen[ids[i]] = true
      local _, ht, hc = string.match(v, '(%d+) (%d+) (%d+)')
      t, c, r = t - tonumber(ht), c - tonumber(hc), r - 1
      found[i] = true
      gone[#gone + 1] = ids[i]
    else
      found[i] = false
    end
  end
  if #gone == 0 then
    if due then
      -- A late commit (a recovered admission, a hold that expired): no write here creates
      -- the holds hash, but the windows it counts in must live on.
      if h[1] or h[4] then redis.call('HSET', holds, '_x', int(now)) end
      renew(keys, ttl)
    end
    return found, due
  end
  redis.call('HDEL', holds, unpack(gone))
  t, c, r = math.max(0, t), math.max(0, c), math.max(0, r)
  if due then
    redis.call('HSET', holds, '_t', int(t), '_c', int(c), '_r', int(r), '_x', int(now))
    renew(keys, ttl)
  else
    redis.call('HSET', holds, '_t', int(t), '_c', int(c), '_r', int(r))
  end
  return found, due
end

-- drop_holds of one id: whether it was there.
local function drop_hold(holds, id, now, ttl, keys)
  local found, due = drop_holds(holds, {id}, now, ttl, keys)
  return found[1], due
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
-- it had totals gets them from its next full pass instead): one read, one write. Returns true
-- if the window's hash is new (it has no lifetime yet: the caller gives it one).
local function add_usage(key, idx, tokens, cost, requests)
  if tokens <= 0 and cost <= 0 and requests <= 0 then return false end
  local ft, fc, fr = 't' .. int(idx), 'c' .. int(idx), 'r' .. int(idx)
  local h = redis.call('HMGET', key, '_T', '_F', '_C', '_R', ft, fc, fr)
  local kept, fresh = h[1] ~= false, false
  if not kept then
    fresh = redis.call('EXISTS', key) == 0
    kept = fresh
  end
  local out = {}
  local function add(field, old, amount)
    if amount > 0 then
      out[#out + 1] = field
      out[#out + 1] = int(tonumber(old or '0') + amount)
    end
  end
  add(ft, h[5], tokens)
  add(fc, h[6], cost)
  add(fr, h[7], requests)
  if kept then
    out[#out + 1] = '_T'
    out[#out + 1] = int(tonumber(h[1] or '0') + tokens)
    out[#out + 1] = '_C'
    out[#out + 1] = int(tonumber(h[3] or '0') + cost)
    add('_R', h[4], requests)
    if not h[2] or idx < tonumber(h[2]) then
      out[#out + 1] = '_F'
      out[#out + 1] = int(idx)
    end
  end
  redis.call('HSET', key, unpack(out))
  return fresh
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
