-- The worker holding the claims of `owner` died (its supervisor saw it): every lease of that
-- claim expires now, for the next reap. `running`, the job it had in hand, is no longer claimed
-- ahead, so its loss counts as a run. Returns how many leases were expired.
local owner = ARGV[1]
local running = ARGV[2]         -- '' when it was between jobs
local now = tonumber(ARGV[3])   -- ms

local count = 0
for _, id in ipairs(redis.call('ZRANGE', processing_key, 0, -1)) do
  if redis.call('HGET', owners_key, id) == owner then
    if id == running then redis.call('HDEL', ahead_key, id) end
    redis.call('ZADD', processing_key, 'XX', now - 1, id)
    count = count + 1
  end
end
return count
