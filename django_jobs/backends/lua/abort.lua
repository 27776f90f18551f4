-- Abort a message of this queue: a waiting, delayed or blocked one is taken out and forgotten,
-- a leased one is flagged for its worker's heartbeat (extend.lua reads the flag; a final settle
-- clears it). Returns {'cancelled', body, settled's flag}, {'asked'}, or {'unknown'} (not here,
-- or kept as failed).
local id = ARGV[1]
local who = ARGV[2]

local body = redis.call('HGET', bodies_key, id)
if not body or redis.call('ZSCORE', failed_key, id) then return {'unknown'} end
if redis.call('ZSCORE', processing_key, id) then
  redis.call('HSET', aborts_key, id, who)
  return {'asked'}
end
redis.call('ZREM', waiting_key, id)
redis.call('ZREM', delayed_key, id)
unblock(id)
forget(id)
return {'cancelled', body, settled(id, 'cancelled')}
