-- Store a message that waits for its parents: blocked (in neither waiting nor delayed) until
-- resolve.lua has seen each of them finish. Its open edges (edges: child NUL parent) are stored
-- before this script, by the same pipeline: a blocked message never lacks one. Like
-- enqueue.lua, a re-dispatched id leaves the failed set and an abort asked of an earlier run of
-- it no longer applies.
local id = ARGV[1]
local body = ARGV[2]
local priority = ARGV[3]
local parents = ARGV[4]         -- how many parents it waits for

redis.call('HSET', bodies_key, id, body)
redis.call('HSET', priorities_key, id, priority)
redis.call('ZREM', failed_key, id)
redis.call('HDEL', errors_key, id)
redis.call('HDEL', aborts_key, id)
redis.call('HSET', blocked_key, id, parents)
return 1
