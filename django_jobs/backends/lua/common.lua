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
local ahead_key = KEYS[11]      -- hash: id -> '1' claimed ahead of its run, '2' and an earlier such claim was lost
local aborts_key = KEYS[12]     -- hash: id -> who asked to abort the job (read by extend.lua)
local dependents_key = KEYS[13] -- zset (lex): parent id NUL child id NUL child queue (attach.lua)
local finished_key = KEYS[14]   -- hash: parent id -> its outcome, until every edge is resolved (outbox)
local blocked_key = KEYS[15]    -- hash: child id -> how many parents it was dispatched with
local edges_key = KEYS[16]      -- zset (lex): child id NUL parent id, each edge of a blocked message still open
local unrecorded_key = KEYS[17] -- zset: failure ms -> id, failed and its Job row not written yet

-- 2^40: one priority step in a waiting score, above any sequence number.
local PRIORITY_STEP = 1099511627776

-- Make `id` ready: waiting by its priority (`prio`, else read from the priorities hash), then
-- FIFO; a blocked worker is woken.
local function ready(id, prio)
  prio = prio or tonumber(redis.call('HGET', priorities_key, id) or '0') or 0
  redis.call('ZADD', waiting_key, -prio * PRIORITY_STEP + redis.call('INCR', sequence_key), id)
  redis.call('LPUSH', notify_key, 1)
  redis.call('LTRIM', notify_key, 0, 99)
end

-- Fencing: true only while `owner` still holds the lease on `id`.
local function owned(id, owner)
  return redis.call('HGET', owners_key, id) == owner and redis.call('ZSCORE', processing_key, id) ~= false
end

-- The lease ends (a settle, or a reap): the message is no longer claimed ahead either.
local function release(id)
  redis.call('ZREM', processing_key, id)
  redis.call('HDEL', owners_key, id)
  redis.call('HDEL', ahead_key, id)
end

-- Failed for good: kept for audit; an abort asked of it is moot.
local function fail(id, now, err)
  redis.call('ZADD', failed_key, now, id)
  redis.call('ZADD', unrecorded_key, now, id)
  redis.call('HSET', errors_key, id, err)
  redis.call('HDEL', aborts_key, id)
end

local function requeue(id, due, now, prio)
  if due > now then
    redis.call('ZADD', delayed_key, due, id)
  else
    ready(id, prio)
  end
end

-- Store a message and make it ready (or delayed until `due`, ms). A re-dispatched id leaves
-- the failed set, and an abort asked of an earlier run of it no longer applies.
local function store(id, body, priority, due, now)
  redis.call('HSET', bodies_key, id, body)
  redis.call('HSET', priorities_key, id, priority)
  redis.call('ZREM', failed_key, id)
  redis.call('HDEL', errors_key, id)
  redis.call('HDEL', aborts_key, id)
  requeue(id, due, now, tonumber(priority))
end

-- Requeue the leased message `id` (fenced on `owner`) with its new body, due at `due`: 1; 0
-- when the lease is lost. A message asked to abort is not requeued: returns who asked, the
-- lease still held (the worker settles it cancelled).
local function requeue_held(id, owner, body, due, now, err)
  if not owned(id, owner) then return 0 end
  local aborted_by = redis.call('HGET', aborts_key, id)
  if aborted_by then return aborted_by end
  release(id)
  redis.call('HSET', bodies_key, id, body)
  redis.call('HSET', errors_key, id, err)
  requeue(id, due, now)
  return 1
end

-- requeue_held for each {id, owner, body, due_ms, error} of `requeues`: one reply each.
local function requeue_each(requeues, now)
  local replies = {}
  for _, r in ipairs(requeues) do
    table.insert(replies, requeue_held(r[1], r[2], r[3], tonumber(r[4]), now, r[5]))
  end
  return replies
end

-- The message is done: forget it. (Nothing requeues a message asked to abort.)
local function forget(id)
  release(id)
  redis.call('HDEL', bodies_key, id)
  redis.call('HDEL', priorities_key, id)
  redis.call('HDEL', errors_key, id)
  redis.call('HDEL', aborts_key, id)
end

-- The bounds of the members of a lex zset (dependents, edges) that start with `id` NUL: a job
-- id holds no NUL, so they are exactly that job's edges, found in O(log N).
local function lex_from(id) return '[' .. id .. '\0' end
local function lex_to(id) return '(' .. id .. '\1' end

-- Whether some message is attached to `id` as its child (a queue without any costs one EXISTS).
local function has_dependents(id)
  if redis.call('EXISTS', dependents_key) == 0 then return false end
  return #redis.call('ZRANGEBYLEX', dependents_key, lex_from(id), lex_to(id), 'LIMIT', 0, 1) > 0
end

-- `id` settled for good with `outcome` ('completed', 'failed' or 'cancelled'). When messages
-- depend on it, the outcome enters the outbox for the caller to resolve their edges (resolve.lua
-- in each child's queue, then drained.lua): returns 2 then, else 1.
local function settled(id, outcome)
  if not has_dependents(id) then return 1 end
  redis.call('HSET', finished_key, id, outcome)
  return 2
end

-- `id` no longer waits: it leaves the blocked hash with its open edges (one step however many).
local function unblock(id)
  redis.call('HDEL', blocked_key, id)
  redis.call('ZREMRANGEBYLEX', edges_key, lex_from(id), lex_to(id))
end

-- Make due delayed messages ready.
local function promote(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', delayed_key, '-inf', now, 'LIMIT', 0, 200)) do
    redis.call('ZREM', delayed_key, id)
    ready(id)
  end
end

-- When the first delayed message is due (ms), or false.
local function next_due()
  return redis.call('ZRANGE', delayed_key, 0, 0, 'WITHSCORES')[2] or false
end

-- Lease `id` to `owner` until `deadline`; returns its body, or false.
local function hold(id, deadline, owner)
  redis.call('ZADD', processing_key, deadline, id)
  redis.call('HSET', owners_key, id, owner)
  return redis.call('HGET', bodies_key, id) or false
end

-- Promote due delayed messages, then lease the first waiting one to `owner` until `deadline`.
-- Returns {id, body} or {false, next_due_ms_or_false}. A message leased singly starts at once:
-- it is not claimed ahead, so its loss counts as a run.
local function lease_next(now, deadline, owner)
  promote(now)
  local popped = redis.call('ZPOPMIN', waiting_key)
  if #popped == 0 then return {false, next_due()} end
  local id = popped[1]
  redis.call('HDEL', ahead_key, id)
  return {id, hold(id, deadline, owner)}
end

-- Promote due delayed messages, then claim up to `limit` waiting ones ahead of their run, in
-- order, all leased to `owner` until `deadline`. Returns flat triples {id, body, must_begin},
-- or {false, next_due_ms_or_false, 0} when none is ready. A message whose earlier claim ahead
-- was lost keeps its '2': its worker must begin it before running it.
local function claim_ahead(now, deadline, owner, limit)
  promote(now)
  local popped = redis.call('ZPOPMIN', waiting_key, limit)
  if #popped == 0 then return {false, next_due(), 0} end
  local claimed = {}
  for i = 1, #popped, 2 do
    local id = popped[i]
    local again = redis.call('HGET', ahead_key, id) == '2'
    if not again then redis.call('HSET', ahead_key, id, '1') end
    table.insert(claimed, id)
    table.insert(claimed, hold(id, deadline, owner))
    table.insert(claimed, again and 1 or 0)
  end
  return claimed
end

-- Ack each {id, owner} of `acks`, fenced one by one: one flag per pair, 1 acked (forgotten),
-- 2 acked with dependents (in the outbox: see settled) or 0 lost (left alone).
local function ack_each(acks)
  local acked = {}
  for _, pair in ipairs(acks) do
    local flag = 0
    if owned(pair[1], pair[2]) then
      forget(pair[1])
      flag = settled(pair[1], 'completed')
    end
    table.insert(acked, flag)
  end
  return acked
end
