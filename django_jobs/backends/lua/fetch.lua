-- Lease the next ready message. Returns {id, body} or {false, next_due_ms_or_false}.
local now = tonumber(ARGV[1])   -- ms
local deadline = ARGV[2]        -- ms: the lease's expiry
local owner = ARGV[3]

return lease_next(now, deadline, owner)
