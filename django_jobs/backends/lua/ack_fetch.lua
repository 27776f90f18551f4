-- ARGV: id, owner, now_ms, lease_deadline_ms, new_owner. Acks a message and leases the next one
-- in one round trip. Returns {0} when the ack is fenced off (nothing is leased then).
if not owned(ARGV[1], ARGV[2]) then return {0} end
forget(ARGV[1])
local leased = lease_next(tonumber(ARGV[3]), ARGV[4], ARGV[5])
return {1, leased[1], leased[2]}
