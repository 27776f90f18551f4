-- Give back under one limit what a lease holds, or what an acquire took that another limit of
-- the job refused. Then, with `wake` and a free slot, return the first parked jobs (the caller
-- wakes the first it can in its queue). Returns {start ms or 0, parked member, ...}.
local now = tonumber(ARGV[1])           -- ms
local member = ARGV[2]                  -- the slot to free ('<job id>|<owner>'), or ''
local job = ARGV[3]
local parked = ARGV[4]                  -- the job's member of the parked set to drop, or ''
local action = ARGV[5]                  -- the job's start `start`: '' keep, 'drop' it, 'restore' its
                                        -- reservation, or 'defer' it: reserved at `at` or later
local start = ARGV[6]
local at = tonumber(ARGV[7])            -- ms
local concurrency = tonumber(ARGV[8])   -- 0: no concurrency limit
local count = tonumber(ARGV[9])
local period = tonumber(ARGV[10])       -- ms
local wake = ARGV[11] == '1'

if member ~= '' then redis.call('ZREM', slots_key, member) end
if parked ~= '' then redis.call('ZREM', parked_key, parked) end
local reserved = 0
if action == 'drop' then
  redis.call('ZREM', window_key, start)
  if redis.call('HGET', reserved_key, job) == start then redis.call('HDEL', reserved_key, job) end
elseif action == 'restore' then
  redis.call('HSET', reserved_key, job, start)
elseif action == 'defer' then
  redis.call('ZREM', window_key, start)
  slide(now, period)
  reserved = math.max(at, next_start(now, count, period))
  redis.call('ZADD', window_key, reserved, start)
  redis.call('HSET', reserved_key, job, start)
end
local reply = {reserved}
if wake and concurrency > 0 and free_slots(now, concurrency) > 0 then
  for _, first in ipairs(redis.call('ZRANGE', parked_key, 0, 9)) do table.insert(reply, first) end
end
return reply
