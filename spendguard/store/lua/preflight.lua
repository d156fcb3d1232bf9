-- Preflight (design.md, "One inference"): one read of every limit that can apply to a request;
-- when the request is allowed, its holds on hard limits and its admission entry, written in the
-- same call.
--
-- KEYS[1]    the team's policy hash ({prefix}:{team}:spend:policy)
-- KEYS[1+i]  the usage hash of candidate i for t0's period, i = 1..n
-- KEYS[n+2], KEYS[n+3]  the rate hashes of the key and of the team
-- KEYS[n+4]  (with an entry) the team's admission entries ({prefix}:{team}:spend:open)
-- ARGV[1]    n
-- ARGV[1+i]  the policy field of candidate i (team:month, api_key:<key>:day, balance, ...)
-- ARGV[n+2]  the record id ("" with no entry and no hold)
-- ARGV[n+3]  the hold in micro-USD a hard limit must fit (the request's worst case)
-- ARGV[n+4]  the requested model ("" checks no model list)
-- ARGV[n+5], ARGV[n+6]  the policy fields of the team's and the key's model lists
-- ARGV[n+7], ARGV[n+8]  the policy fields of the key's and the team's rates ("" none)
-- ARGV[n+9]  now (epoch ms), ARGV[n+10] the tokens a TPM rate reserves, ARGV[n+11] how long
--            (ms) an in-flight entry counts at most
-- ARGV[n+12] (optional) the entry's value
--
-- A model list is newline-separated globs (* any run, ? any one byte, the rest literal); a
-- request whose model matches no glob of a list that exists gets "model" back, and nothing is
-- read or written further.
--
-- A limit is soft under its field, hard under "h:" .. field, hard and fitting a refused
-- request's output cap under "f:" .. field. Returns 0 when the policy hash is absent (a miss:
-- the caller loads it from the ledger). Otherwise a flat list, 5 entries per candidate: limit,
-- settled, pending, hard ("1", "2" when it fits, or nil), and the limit's own alert thresholds
-- (its "a:" field: "50,80", "" for none; nil: the gateway's default). A nil limit means "no policy" and then
-- its usage key is not even read; nil settled means the usage key is absent (a miss for that
-- key). The "balance" field marks that the team has a prepaid account; its limit is the balance
-- key's t (topped up).
--
-- The rule, the same as the caller's on exact integers: a soft limit denies once usage
-- (settled + pending) reaches it; a hard one denies when usage + hold would pass it; an absent
-- usage key is a miss. Only an allowed request writes: its hold, as a marker h:<id> added to
-- pending in every hard key (postflight replaces it with the actual cost, or releases it), and
-- its entry, so a gateway killed while the request runs cannot lose it. Amounts are compared
-- exactly, as decimal strings when they are too long for a double.
--
-- Rates (design.md, "Rates") are checked only when every limit allows, key first: a rate
-- field holds "rpm tpm par" (0: none). Two entries follow the 5n: the rate that denied
-- ("key:rpm", "team:par", ... or nil), then each rated scope's state "rpm tpm par pr r pt t n"
-- (key, team; nil for a scope without rates), after counting the request when it is allowed.
local n = tonumber(ARGV[1])
if n == nil or #KEYS < n + 3 or #ARGV < n + 11 then
  return redis.error_reply('spendguard preflight: argument count')
end
local rid, hold, model, entry = ARGV[n + 2], ARGV[n + 3], ARGV[n + 4], ARGV[n + 12]
-- One read of the policy hash: its marker (absent: a miss), the model lists and rates, then
-- each candidate's soft, hard, hard-and-fitting and alert fields.
local fields = {'_loaded', ARGV[n + 5], ARGV[n + 6], ARGV[n + 7], ARGV[n + 8]}
for i = 1, n do
  fields[2 + 4 * i] = ARGV[i + 1]
  fields[3 + 4 * i] = 'h:' .. ARGV[i + 1]
  fields[4 + 4 * i] = 'f:' .. ARGV[i + 1]
  fields[5 + 4 * i] = 'a:' .. ARGV[i + 1]
end
local policy = redis.call('HMGET', KEYS[1], unpack(fields))
if not policy[1] and redis.call('EXISTS', KEYS[1]) == 0 then
  return 0 -- (fill always writes the marker; a hash without it still counts as loaded)
end
local scoped = {policy[2], policy[3], policy[4], policy[5]}

local function glob_matches(glob, name)
  local pattern = string.gsub(glob, '[%^%$%(%)%%%.%[%]%+%-]', '%%%0')
  pattern = string.gsub(pattern, '%*', '.*')
  pattern = string.gsub(pattern, '%?', '.')
  return string.find(name, '^' .. pattern .. '$') ~= nil
end
if model ~= '' then
  for i = 1, 2 do
    local list = scoped[i]
    if list then
      local allowed = false
      for glob in string.gmatch(list, '[^\n]+') do
        if glob_matches(glob, model) then
          allowed = true
          break
        end
      end
      if not allowed then
        return 'model'
      end
    end
  end
end

local function add(a, b)
  local out, carry, i, j = {}, 0, #a, #b
  while i > 0 or j > 0 or carry > 0 do
    local d = carry
    if i > 0 then d = d + string.byte(a, i) - 48 end
    if j > 0 then d = d + string.byte(b, j) - 48 end
    out[#out + 1] = string.char(48 + d % 10)
    carry = math.floor(d / 10)
    i, j = i - 1, j - 1
  end
  return string.reverse(table.concat(out))
end
local function at_least(used, limit) -- used >= limit, on decimal strings
  used = string.gsub(used, '^0+', '')
  limit = string.gsub(limit, '^0+', '')
  if #used ~= #limit then
    return #used > #limit
  end
  return used >= limit
end
local function uint(v)
  return type(v) == 'string' and #v > 0 and string.match(v, '^%d+$') ~= nil
end
if not uint(hold) then
  return redis.error_reply('spendguard preflight: bad hold')
end

local limits = {}
for j = 1, 4 * n do
  limits[j] = policy[5 + j]
end
local out = {}
local allow = true
local holds = {}
for i = 1, n do
  local limit, hard, fits = limits[4 * i - 3], limits[4 * i - 2], limits[4 * i - 1]
  if fits then
    hard = fits
  end
  if hard then
    limit = hard
  end
  if limit then
    local usage = redis.call('HMGET', KEYS[i + 1], 's', 'p', 't')
    if ARGV[i + 1] == 'balance' then
      limit = usage[3] or '0'
    end
    out[5 * i - 4] = limit
    out[5 * i - 3] = usage[1]
    out[5 * i - 2] = usage[2]
    out[5 * i - 1] = (fits and '2') or (hard and '1') or false
    out[5 * i] = limits[4 * i] or false
    if allow then
      local settled, pending = usage[1], usage[2] or '0'
      if not settled then
        allow = false -- a miss: the caller fills and asks again
      elseif #settled <= 15 and #pending <= 15 and #limit <= 15 and #hold <= 15 then
        -- Every operand below 10^15: their sums are exact in a double (the common case).
        local used = tonumber(settled) + tonumber(pending)
        if hard then
          if used + tonumber(hold) > tonumber(limit) then
            allow = false
          else
            holds[#holds + 1] = KEYS[i + 1]
          end
        elseif used >= tonumber(limit) then
          allow = false
        end
      else
        local used
        if uint(settled) and uint(pending) then
          used = add(settled, pending)
        else -- a pending total below 0 never happens; read it as a number if it does
          used = tostring(tonumber(settled) + tonumber(pending))
        end
        if hard then
          -- used + hold > limit, i.e. used + hold >= limit + 1
          if at_least(add(used, hold), add(limit, '1')) then
            allow = false
          else
            holds[#holds + 1] = KEYS[i + 1]
          end
        elseif at_least(used, limit) then
          allow = false
        end
      end
    end
  else
    out[5 * i - 4] = false
    out[5 * i - 3] = false
    out[5 * i - 2] = false
    out[5 * i - 1] = false
    out[5 * i] = false
  end
end
local rated = {}
if allow and (scoped[3] or scoped[4]) then
  local W, T, now, tokens, ttl = 60000, 600, tonumber(ARGV[n + 9]), tonumber(ARGV[n + 10]), tonumber(ARGV[n + 11])
  if not (now and tokens and ttl) then
    return redis.error_reply('spendguard preflight: bad rate arguments')
  end
  local minute = math.floor(now / W)
  local weight = T - math.floor((now - minute * W) / 100) -- 100 ms ticks the last 60 s cover
  out[5 * n + 1] = false
  -- This request's in-flight entry: read with the counters and written with them (one
  -- read and one write per scope), and each scope's state in the reply reuses the policy's
  -- "rpm tpm par" as stored: a script's cost here is mostly its calls and its number-to-text
  -- conversions.
  local slot = 'f:' .. rid
  for s = 1, 2 do
    local spec = scoped[s + 2]
    if spec then
      local key = KEYS[n + 1 + s]
      local rpm, tpm, par = string.match(spec, '^(%d+) (%d+) (%d+)$')
      rpm, tpm, par = tonumber(rpm), tonumber(tpm), tonumber(par)
      local h = redis.call('HMGET', key, 'm', 'r', 't', 'pr', 'pt', 'n', 'e', slot)
      local m = tonumber(h[1]) or minute
      local rolled = h[1] == false or m < minute -- a new key, or a new minute: write it all
      local r, t, pr, pt = tonumber(h[2]) or 0, tonumber(h[3]) or 0, tonumber(h[4]) or 0, tonumber(h[5]) or 0
      local inflight, e = tonumber(h[6]) or 0, tonumber(h[7])
      if m == minute - 1 then
        pr, pt, r, t = r, t, 0, 0
      elseif m < minute - 1 then
        pr, pt, r, t = 0, 0, 0, 0
      end
      if e and now >= e then
        -- Some entry may have outlived its deadline (its gateway died): drop every such one.
        local all = redis.call('HGETALL', key)
        inflight, e = 0, nil
        for i = 1, #all, 2 do
          if string.sub(all[i], 1, 2) == 'f:' then
            local deadline = tonumber(string.match(all[i + 1], '^%d+'))
            if deadline <= now then
              redis.call('HDEL', key, all[i])
              if all[i] == slot then h[8] = false end
            else
              inflight = inflight + 1
              if not e or deadline < e then e = deadline end
            end
          end
        end
        if e then
          redis.call('HSET', key, 'n', inflight, 'e', e)
        else
          redis.call('HDEL', key, 'n', 'e')
        end
      end
      local scope = s == 1 and 'key:' or 'team:'
      if allow == true then
        if rpm > 0 and pr * weight + (r + 1) * T > rpm * T then
          allow = scope .. 'rpm'
        elseif tpm > 0 and pt * weight + (t + tokens) * T > tpm * T then
          allow = scope .. 'tpm'
        elseif par > 0 and inflight + 1 > par then
          allow = scope .. 'par'
        end
      end
      rated[s] = {key, rpm, tpm, par, pr, r, pt, t, inflight, e, rolled, h[8], spec}
    end
  end
  if allow ~= true then
    out[5 * n + 1] = allow
    allow = false
  else
    local deadline = now + ttl
    local held = deadline .. ' ' .. minute .. ' '
    for s = 1, 2 do
      local q = rated[s]
      if q then
        local key, tpm, par = q[1], q[3], q[4]
        q[6] = q[6] + 1
        local write = {'r', q[6]}
        if tpm > 0 then
          q[8] = q[8] + tokens
        end
        if q[11] then
          write = {'m', minute, 'r', q[6], 'pr', q[5], 'pt', q[7], 't', q[8]}
        elseif tpm > 0 then
          write[3], write[4] = 't', q[8]
        end
        if tpm > 0 or par > 0 then
          if not q[12] then -- (a preflight run again for the same id counts it once)
            write[#write + 1] = slot
            write[#write + 1] = held .. (tpm > 0 and ARGV[n + 10] or '-')
            q[9] = q[9] + 1
          end
          write[#write + 1] = 'n'
          write[#write + 1] = q[9]
          if not q[10] then
            write[#write + 1] = 'e'
            write[#write + 1] = deadline
          end
        end
        redis.call('HSET', key, unpack(write))
        if q[11] then
          -- Set at most a minute ago, this outlives every entry's deadline and both minutes.
          redis.call('PEXPIRE', key, math.max(2 * W, ttl) + W)
        end
      end
    end
  end
  for s = 1, 2 do
    local q = rated[s]
    out[5 * n + 1 + s] = q and table.concat({q[13], q[5], q[6], q[7], q[8], q[9]}, ' ') or false
  end
end
if allow then
  if hold ~= '0' then
    for _, key in ipairs(holds) do
      if redis.call('HSETNX', key, 'h:' .. rid, hold) == 1 then
        redis.call('HINCRBY', key, 'p', hold)
      end
    end
  end
  if entry then
    redis.call('HSET', KEYS[n + 4], rid, entry)
  end
end
return out
