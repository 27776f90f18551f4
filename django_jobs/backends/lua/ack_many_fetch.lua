-- Ack many leased messages and requeue failed runs, then claim up to `limit` ready ones ahead
-- of their run, in one round trip: the claim happens whether or not some were fenced off, and
-- may take a failed run just requeued. Returns {ack_each's flags, claim_ahead's reply,
-- requeue_each's replies}.
local acks = ARGV[1]            -- JSON: [[id, owner], ...]
local now = tonumber(ARGV[2])   -- ms
local deadline = ARGV[3]        -- ms: the new leases' expiry
local owner = ARGV[4]           -- the new batch's token
local limit = tonumber(ARGV[5])
local requeues = ARGV[6]        -- JSON: [[id, owner, body, due ms, error], ...]

local acked = ack_each(cjson.decode(acks))
local requeued = requeue_each(cjson.decode(requeues), now)
return {acked, claim_ahead(now, deadline, owner, limit), requeued}
