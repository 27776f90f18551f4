-- Prelude of every django-jobs Redis script: the keys of one queue, then the helpers.
-- Every script receives all of one queue's keys, in the order of RedisBackend's QueueKeys.
local waiting_key = KEYS[1]     -- zset: -priority * 2^40 + sequence -> id (ZPOPMIN: priority, then FIFO)
local delayed_key = KEYS[2]     -- zset: due ms -> id
local processing_key = KEYS[3]  -- zset: lease deadline ms -> id
local owners_key = KEYS[4]      -- hash: id -> owner token (fencing)
local bodies_key = KEYS[5]      -- hash: id -> message
local priorities_key = KEYS[6]  -- hash: id -> priority
local sequence_key = KEYS[7]    -- counter: FIFO order within a priority
local notify_key = KEYS[8]      -- list: wakes blocked workers
local failed_key = KEYS[9]      -- zset: failure ms -> id, kept for audit
local errors_key = KEYS[10]     -- hash: id -> last error

-- 2^40: one priority step in a waiting score, above any sequence number.
local PRIORITY_STEP = 1099511627776

local function ready(id)
  local prio = tonumber(redis.call('HGET', priorities_key, id) or '0') or 0
  redis.call('ZADD', waiting_key, -prio * PRIORITY_STEP + redis.call('INCR', sequence_key), id)
  redis.call('LPUSH', notify_key, 1)
  redis.call('LTRIM', notify_key, 0, 99)
end

-- Fencing: true only while `owner` still holds the lease on `id`.
local function owned(id, owner)
  return redis.call('HGET', owners_key, id) == owner and redis.call('ZSCORE', processing_key, id) ~= false
end

local function release(id)
  redis.call('ZREM', processing_key, id)
  redis.call('HDEL', owners_key, id)
end

local function fail(id, now, err)
  redis.call('ZADD', failed_key, now, id)
  redis.call('HSET', errors_key, id, err)
end

local function requeue(id, due, now)
  if due > now then
    redis.call('ZADD', delayed_key, due, id)
  else
    ready(id)
  end
end

-- The message is done: forget it.
local function forget(id)
  release(id)
  redis.call('HDEL', bodies_key, id)
  redis.call('HDEL', priorities_key, id)
  redis.call('HDEL', errors_key, id)
end

-- Promote due delayed messages, then lease the first waiting one to `owner` until `deadline`.
-- Returns {id, body} or {false, next_due_ms_or_false}.
local function lease_next(now, deadline, owner)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', delayed_key, '-inf', now, 'LIMIT', 0, 200)) do
    redis.call('ZREM', delayed_key, id)
    ready(id)
  end
  local popped = redis.call('ZPOPMIN', waiting_key)
  if #popped == 0 then
    local nxt = redis.call('ZRANGE', delayed_key, 0, 0, 'WITHSCORES')
    return {false, nxt[2] or false}
  end
  local id = popped[1]
  redis.call('ZADD', processing_key, deadline, id)
  redis.call('HSET', owners_key, id, owner)
  return {id, redis.call('HGET', bodies_key, id) or false}
end
