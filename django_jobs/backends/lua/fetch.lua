-- ARGV: now_ms, lease_deadline_ms, owner.
return lease_next(tonumber(ARGV[1]), ARGV[2], ARGV[3])
