-- Store a message and make it ready (or delayed until due). A re-dispatched id leaves the
-- failed set, and an abort asked of an earlier run of it no longer applies.
local id = ARGV[1]
local body = ARGV[2]
local priority = ARGV[3]
local due = tonumber(ARGV[4])   -- ms
local now = tonumber(ARGV[5])   -- ms

redis.call('HSET', bodies_key, id, body)
redis.call('HSET', priorities_key, id, priority)
redis.call('ZREM', failed_key, id)
redis.call('HDEL', errors_key, id)
redis.call('HDEL', aborts_key, id)
requeue(id, due, now)
return 1
