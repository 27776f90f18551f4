-- Prelude of every django-jobs Redis script. One queue's keys, always passed in this order:
-- waiting (zset: -priority * 2^40 + sequence -> id, so ZPOPMIN is priority then FIFO),
-- delayed (zset: due ms -> id), processing (zset: lease deadline ms -> id), owners (hash:
-- id -> owner token), bodies (hash: id -> message), priorities (hash: id -> priority),
-- sequence (counter), notify (list: wakes blocked workers), failed (zset: ms -> id),
-- errors (hash: id -> last error).
local W, D, R, O, B, PR, S, N, F, E = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]

local function ready(id)
  local prio = tonumber(redis.call('HGET', PR, id) or '0') or 0
  redis.call('ZADD', W, -prio * 1099511627776 + redis.call('INCR', S), id)
  redis.call('LPUSH', N, 1)
  redis.call('LTRIM', N, 0, 99)
end

-- Fencing: true only while `owner` still holds the lease on `id`.
local function owned(id, owner)
  return redis.call('HGET', O, id) == owner and redis.call('ZSCORE', R, id) ~= false
end

local function release(id)
  redis.call('ZREM', R, id)
  redis.call('HDEL', O, id)
end

local function fail(id, now, err)
  redis.call('ZADD', F, now, id)
  redis.call('HSET', E, id, err)
end

local function requeue(id, due, now)
  if due > now then
    redis.call('ZADD', D, due, id)
  else
    ready(id)
  end
end

-- The message is done: forget it.
local function forget(id)
  release(id)
  redis.call('HDEL', B, id)
  redis.call('HDEL', PR, id)
  redis.call('HDEL', E, id)
end

-- Promote due delayed messages, then lease the first waiting one to `owner` until `deadline`.
-- Returns {id, body} or {false, next_due_ms_or_false}.
local function lease_next(now, deadline, owner)
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
  redis.call('ZADD', R, deadline, id)
  redis.call('HSET', O, id, owner)
  return {id, redis.call('HGET', B, id) or false}
end
