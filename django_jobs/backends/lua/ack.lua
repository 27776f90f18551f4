-- ARGV: id, owner. The message is done: forget it.
local id = ARGV[1]
if not owned(id, ARGV[2]) then return 0 end
release(id)
redis.call('HDEL', B, id)
redis.call('HDEL', PR, id)
return 1
