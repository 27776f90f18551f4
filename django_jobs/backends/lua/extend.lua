-- ARGV: id, owner, new_deadline_ms. The heartbeat.
local id = ARGV[1]
if not owned(id, ARGV[2]) then return 0 end
redis.call('ZADD', R, 'XX', ARGV[3], id)
return 1
