-- The worker holding the claims of `owner` died (its supervisor saw it): every lease of that
-- claim expires now, for the next reap. The `counted` jobs (the one it had in hand, and its failed
-- runs whose requeues were not written yet) are no longer claimed ahead, so the loss of each
-- counts as a run. With `unrun` (the claim's answer was lost: no handler saw its jobs), every
-- job of the claim is claimed ahead instead, and goes back uncounted. Returns how many leases
-- were expired.
local owner = ARGV[1]
local now = tonumber(ARGV[2])   -- ms
local tokens = ARGV[3]          -- JSON: [id, ...]
local unrun = ARGV[4] == '1'

local counted = {}
for _, id in ipairs(cjson.decode(tokens)) do counted[id] = true end

local count = 0
for _, id in ipairs(redis.call('ZRANGE', processing_key, 0, -1)) do
  if redis.call('HGET', owners_key, id) == owner then
    if unrun then
      redis.call('HSETNX', ahead_key, id, '1')
    elseif counted[id] then
      redis.call('HDEL', ahead_key, id)
    end
    redis.call('ZADD', processing_key, 'XX', now - 1, id)
    count = count + 1
  end
end
return count
