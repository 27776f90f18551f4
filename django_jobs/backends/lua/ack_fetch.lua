-- Ack a leased message and lease the next one in one round trip. Returns {0} when the ack is
-- fenced off (nothing is leased then), else {settled's flag, id, body} or
-- {settled's flag, false, next_due_ms_or_false}.
local id = ARGV[1]
local owner = ARGV[2]
local now = tonumber(ARGV[3])   -- ms
local deadline = ARGV[4]        -- ms: the new lease's expiry
local new_owner = ARGV[5]

if not owned(id, owner) then return {0} end
forget(id)
local flag = settled(id, 'completed')
local leased = lease_next(now, deadline, new_owner)
return {flag, leased[1], leased[2]}
