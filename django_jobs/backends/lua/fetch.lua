-- ARGV: now_ms, lease_deadline_ms, owner. Promotes due delayed messages, then leases the first
-- waiting one. Returns {id, body} or {false, next_due_ms_or_false}.
local now = tonumber(ARGV[1])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', D, '-inf', now, 'LIMIT', 0, 200)) do
  redis.call('ZREM', D, id)
  ready(id)
end
local popped = redis.call('ZPOPMIN', W)
if #popped == 0 then
  local nxt = redis.call('ZRANGE', D, 0, 0, 'WITHSCORES')
  return {false, nxt[2] or false}
end
local id = popped[1]
redis.call('ZADD', R, ARGV[2], id)
redis.call('HSET', O, id, ARGV[3])
return {id, redis.call('HGET', B, id) or false}
