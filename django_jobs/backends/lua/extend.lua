-- The heartbeat: push a held lease's deadline.
local id = ARGV[1]
local owner = ARGV[2]
local deadline = ARGV[3]        -- ms: the new expiry

if not owned(id, owner) then return 0 end
redis.call('ZADD', processing_key, 'XX', deadline, id)
return 1
