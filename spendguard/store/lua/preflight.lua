-- Preflight (design.md, "One inference"): one read of every limit that can apply to a request,
-- and, when the request is allowed, its admission entry written in the same call.
--
-- KEYS[1]    the team's policy hash ({prefix}:{team}:spend:policy)
-- KEYS[1+i]  the usage hash of candidate i for t0's period
-- KEYS[n+2]  (with an entry) the team's admission entries ({prefix}:{team}:spend:open)
-- ARGV[i]    the policy field of candidate i (team:month, api_key:<key>:day, ...), i = 1..n
-- ARGV[n+1], ARGV[n+2]  (with an entry) the record id and the entry's value
--
-- Returns 0 when the policy hash is absent (a miss: the caller loads it from the ledger).
-- Otherwise a flat list, 3 entries per candidate: limit, settled, pending. A nil limit means
-- "no policy" and then its usage key is not even read (no policy, no usage lookups);
-- nil settled means the usage key is absent (a miss for that key). The "balance" field only
-- marks that the team has a prepaid account; its limit is the balance key's t (topped up).
--
-- The caller decides on exact integers; the script applies the same rule (the first usage at
-- or over its limit denies; an absent usage key is a miss) only to know whether to write the
-- entry: an inference that will call the provider leaves a trace before it does, so a gateway
-- killed while it runs cannot lose it. Amounts are compared exactly, as decimal strings when
-- they are too long for a double.
local n = #KEYS - 1
local entry = false
if #ARGV == n + 1 then
  n = n - 1
  entry = true
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
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
local function at_least(used, limit)
  used = string.gsub(used, '^0+', '')
  limit = string.gsub(limit, '^0+', '')
  if #used ~= #limit then
    return #used > #limit
  end
  return used >= limit
end
local function uint(v)
  return type(v) == 'string' and string.match(v, '^%d+$') ~= nil
end

local fields = {}
for i = 1, n do
  fields[i] = ARGV[i]
end
local limits = redis.call('HMGET', KEYS[1], unpack(fields))
local out = {}
local allow = true
for i = 1, n do
  local limit = limits[i]
  if limit then
    local usage = redis.call('HMGET', KEYS[i + 1], 's', 'p', 't')
    if ARGV[i] == 'balance' then
      limit = usage[3] or '0'
    end
    out[3 * i - 2] = limit
    out[3 * i - 1] = usage[1]
    out[3 * i] = usage[2]
    if allow then
      local settled, pending = usage[1], usage[2] or '0'
      if not settled then
        allow = false -- a miss: the caller fills and asks again
      elseif uint(settled) and uint(pending) and uint(limit) then
        if at_least(add(settled, pending), limit) then
          allow = false
        end
      elseif tonumber(settled) + tonumber(pending) >= tonumber(limit) then
        allow = false
      end
    end
  else
    out[3 * i - 2] = false
    out[3 * i - 1] = false
    out[3 * i] = false
  end
end
if entry and allow then
  redis.call('HSET', KEYS[#KEYS], ARGV[n + 1], ARGV[n + 2])
end
return out
