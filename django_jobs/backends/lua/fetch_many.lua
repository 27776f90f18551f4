-- Claim up to `limit` ready messages ahead of their run (claim_ahead's reply).
local now = tonumber(ARGV[1])   -- ms
local deadline = ARGV[2]        -- ms: the leases' expiry
local owner = ARGV[3]           -- one token for the batch; fencing is per message (id + token)
local limit = tonumber(ARGV[4])

return claim_ahead(now, deadline, owner, limit)
