-- Prelude of every limit script: the keys of ONE limit (its own hash tag, one cluster slot),
-- then the helpers. Every limit script receives them in the order of RedisLimitKeys.
local slots_key = KEYS[1]       -- zset: '<job id>|<owner>' -> lease deadline ms: concurrency slots held
local window_key = KEYS[2]      -- zset: '<job id>|<owner>' -> start ms: starts granted or reserved (rate)
local reserved_key = KEYS[3]    -- hash: job id -> its member of the window, a start reserved for it
local parked_key = KEYS[4]      -- zset: JSON [queue, job id] -> park ms (ties: +1): jobs waiting for a slot, oldest first

-- Free concurrency slots. A slot whose lease deadline passed is dropped first: its worker died
-- or stalled, and the slot frees with the lease.
local function free_slots(now, concurrency)
  redis.call('ZREMRANGEBYSCORE', slots_key, '-inf', now)
  return concurrency - redis.call('ZCARD', slots_key)
end

-- Starts at or before now - period no longer matter; a reservation among them was never used.
local function slide(now, period)
  local edge = now - period
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', window_key, '-inf', edge)) do
    local job = member:match('^(.*)|')  -- the owner token after the last '|' is hex
    if job and redis.call('HGET', reserved_key, job) == member then redis.call('HDEL', reserved_key, job) end
  end
  redis.call('ZREMRANGEBYSCORE', window_key, '-inf', edge)
end

-- limits.rate_slot / limits.next_start: the earliest time, at or after now, at which one more
-- start keeps every span of `period` at `count` starts or fewer: now while the window (slid)
-- holds fewer than `count` starts, granted or reserved; else `period` after the count-th latest.
local function next_start(now, count, period)
  if redis.call('ZCARD', window_key) < count then return now end
  local nth = redis.call('ZREVRANGE', window_key, count - 1, count - 1, 'WITHSCORES')
  return math.max(now, tonumber(nth[2]) + period)
end
