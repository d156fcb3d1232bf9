-- Return a hold: a refused, failed or cancelled request counts nothing.
-- KEYS: holds. ARGV: hold id. Reply: 1 if it was still there.
if drop_hold(KEYS[1], ARGV[1]) then return 1 end
return 0
