-- Requeue a leased message: ready again, or delayed until due. A message asked to abort is not
-- requeued: returns who asked, the lease still held (the worker settles it cancelled).
local id = ARGV[1]
local owner = ARGV[2]
local body = ARGV[3]            -- re-serialised with attempts + 1 (unchanged when the run is not counted)
local due = tonumber(ARGV[4])   -- ms
local now = tonumber(ARGV[5])   -- ms
local last_error = ARGV[6]

if not owned(id, owner) then return 0 end
local aborted_by = redis.call('HGET', aborts_key, id)
if aborted_by then return aborted_by end
release(id)
redis.call('HSET', bodies_key, id, body)
redis.call('HSET', errors_key, id, last_error)
requeue(id, due, now)
return 1
