-- The heartbeat: push a held lease's deadline. With `begin`, a message claimed ahead starts
-- its run: it is no longer claimed ahead, so its loss counts as a run from now on.
-- Returns 0 when the lease is lost, else who asked to abort the job, or 1 when nobody did.
local id = ARGV[1]
local owner = ARGV[2]
local deadline = ARGV[3]        -- ms: the new expiry
local begin = ARGV[4] == '1'

if not owned(id, owner) then return 0 end
if begin then redis.call('HDEL', ahead_key, id) end
redis.call('ZADD', processing_key, 'XX', deadline, id)
return redis.call('HGET', aborts_key, id) or 1
