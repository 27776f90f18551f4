-- Take one start of a job under one limit (concurrency, then rate). The caller asks every limit
-- of the job, and undoes what was taken where another one refused (limit_release.lua).
-- Returns {status, start member or '', start kind, start ms or 0}:
--   {1, member, 'fresh' | 'due' | '', 0}: granted (its slot taken; its start counted now, or at
--     the reserved time that came: 'due'; '' without a rate);
--   {0, '', '', 0}: no free slot: parked, nothing taken;
--   {2, member, 'reserved' | 'early', start}: the rate allows it at `start`, which is reserved
--     for it ('early': its reservation made before is not due yet); no slot taken.
local now = tonumber(ARGV[1])           -- ms
local member = ARGV[2]                  -- '<job id>|<owner>': this lease
local job = ARGV[3]
local deadline = tonumber(ARGV[4])      -- ms: the lease's expiry, the slot's
local concurrency = tonumber(ARGV[5])   -- 0: no concurrency limit
local count = tonumber(ARGV[6])         -- 0: no rate limit
local period = tonumber(ARGV[7])        -- ms
local grace = tonumber(ARGV[8])         -- ms: a reserved start is due up to this late (limits.reservation_state)
local parked = ARGV[9]                  -- this job's member of the parked set

if count > 0 then slide(now, period) end
if concurrency > 0 and not redis.call('ZSCORE', slots_key, member) and free_slots(now, concurrency) <= 0 then
  -- Parked last (after any parked in the same millisecond); parked already, it keeps its place.
  local last = redis.call('ZREVRANGE', parked_key, 0, 0, 'WITHSCORES')[2]
  redis.call('ZADD', parked_key, 'NX', last and math.max(now, tonumber(last) + 1) or now, parked)
  return {0, '', '', 0}
end
redis.call('ZREM', parked_key, parked)
local used, kind = '', ''
if count > 0 then
  local reservation = redis.call('HGET', reserved_key, job)
  local start = reservation and tonumber(redis.call('ZSCORE', window_key, reservation))
  if start and now < start then return {2, reservation, 'early', start} end
  if start and now - start <= math.min(grace, period) then
    redis.call('HDEL', reserved_key, job)
    used, kind = reservation, 'due'
  else
    if reservation then                 -- lapsed (came back too late) or lost: ask again
      redis.call('ZREM', window_key, reservation)
      redis.call('HDEL', reserved_key, job)
    end
    start = next_start(now, count, period)
    redis.call('ZADD', window_key, start, member)
    if start > now then
      redis.call('HSET', reserved_key, job, member)
      return {2, member, 'reserved', start}
    end
    used, kind = member, 'fresh'
  end
end
if concurrency > 0 then redis.call('ZADD', slots_key, deadline, member) end
return {1, used, kind, 0}
