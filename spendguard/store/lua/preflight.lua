-- Preflight (design.md, "One inference"): one read of every limit that can apply to a request.
-- Read-only, so the decision itself is made by the caller on exact integers.
--
-- KEYS[1]    the team's policy hash ({prefix}:{team}:spend:policy)
-- KEYS[1+i]  the usage hash of candidate i for t0's period
-- ARGV[i]    the policy field of candidate i (team:month, api_key:<key>:day, ...)
--
-- Returns 0 when the policy hash is absent (a miss: the caller loads it from the ledger).
-- Otherwise a flat list, 3 entries per candidate: limit, settled, pending. A nil limit means
-- "no policy" and then its usage key is not even read (no policy, no usage lookups);
-- nil settled means the usage key is absent (a miss for that key). The "balance" field only
-- marks that the team has a prepaid account; its limit is the balance key's t (topped up).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local limits = redis.call('HMGET', KEYS[1], unpack(ARGV))
local out = {}
for i = 1, #ARGV do
  local limit = limits[i]
  if limit then
    local usage = redis.call('HMGET', KEYS[i + 1], 's', 'p', 't')
    if ARGV[i] == 'balance' then
      limit = usage[3] or '0'
    end
    out[3 * i - 2] = limit
    out[3 * i - 1] = usage[1]
    out[3 * i] = usage[2]
  else
    out[3 * i - 2] = false
    out[3 * i - 1] = false
    out[3 * i] = false
  end
end
return out
