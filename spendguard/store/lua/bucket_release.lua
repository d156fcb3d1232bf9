-- Return holds: a refused, failed or cancelled request counts nothing, nor does a stocked hold
-- no request took (bucket_stock.lua).
-- KEYS: holds. ARGV: the hold ids. Reply: how many were still there.
local n = 0
for i = 1, #ARGV do
  if drop_hold(KEYS[1], ARGV[i]) then n = n + 1 end
end
return n
