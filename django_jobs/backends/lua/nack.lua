-- Requeue a leased message: ready again, or delayed until due (requeue_held: 1, 0 lost, or
-- who asked to abort it, the lease still held).
local id = ARGV[1]
local owner = ARGV[2]
local body = ARGV[3]            -- re-serialised with attempts + 1 (unchanged when the run is not counted)
local due = tonumber(ARGV[4])   -- ms
local last_error = ARGV[5]
local now = tonumber(ARGV[6])   -- ms

return requeue_held(id, owner, body, due, now, last_error)
