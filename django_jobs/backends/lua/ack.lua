-- Settle a leased message for good: forget it.
local id = ARGV[1]
local owner = ARGV[2]

if not owned(id, owner) then return 0 end
forget(id)
return 1
