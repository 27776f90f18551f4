-- ARGV: id, owner, body (may be empty: keep the stored one), now_ms, error. Kept in failed for audit.
local id = ARGV[1]
if not owned(id, ARGV[2]) then return 0 end
release(id)
if ARGV[3] ~= '' then redis.call('HSET', B, id, ARGV[3]) end
fail(id, tonumber(ARGV[4]), ARGV[5])
return 1
