-- ARGV: id, owner, body (re-serialised with attempts + 1), due_ms, now_ms, error.
local id = ARGV[1]
if not owned(id, ARGV[2]) then return 0 end
release(id)
redis.call('HSET', B, id, ARGV[3])
redis.call('HSET', E, id, ARGV[6])
requeue(id, tonumber(ARGV[4]), tonumber(ARGV[5]))
return 1
