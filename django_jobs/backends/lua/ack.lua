-- Settle a leased message for good: forget it. Returns 0 when fenced off, else settled's flag.
local id = ARGV[1]
local owner = ARGV[2]
local outcome = ARGV[3]         -- 'completed', or 'cancelled' (an aborted run)

if not owned(id, owner) then return 0 end
forget(id)
return settled(id, outcome)
