-- Abort a message of this queue: a waiting, delayed or blocked one is taken out and forgotten,
-- a leased one is flagged for its worker's heartbeat (extend.lua and its check between beats read
-- the flag; a final settle clears it) unless it was already: the first request stands. Returns
-- {'cancelled', body, settled's flag}, {'asked'}, {'already', who asked first}, or {'unknown'}
-- (not here, or kept as failed).
local id = ARGV[1]
local who = ARGV[2]

local body = redis.call('HGET', bodies_key, id)
if not body or redis.call('ZSCORE', failed_key, id) then return {'unknown'} end
if redis.call('ZSCORE', processing_key, id) then
  local asked = redis.call('HGET', aborts_key, id)
  if asked then return {'already', asked} end
  redis.call('HSET', aborts_key, id, who)
  return {'asked'}
end
redis.call('ZREM', waiting_key, id)
redis.call('ZREM', delayed_key, id)
unblock(id)
forget(id)
return {'cancelled', body, settled(id, 'cancelled')}
