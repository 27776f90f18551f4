-- ARGV: id, body, priority, due_ms, now_ms. A re-dispatched id leaves the failed set.
local id, due, now = ARGV[1], tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('HSET', B, id, ARGV[2])
redis.call('HSET', PR, id, ARGV[3])
redis.call('ZREM', F, id)
redis.call('HDEL', E, id)
requeue(id, due, now)
return 1
