-- Ack many leased messages, then claim up to `limit` ready ones ahead of their run, in one
-- round trip: the claim happens whether or not some acks were fenced off.
-- Returns {ack_each's flags, claim_ahead's reply}.
local acks = ARGV[1]            -- JSON: [[id, owner], ...]
local now = tonumber(ARGV[2])   -- ms
local deadline = ARGV[3]        -- ms: the new leases' expiry
local owner = ARGV[4]           -- the new batch's token
local limit = tonumber(ARGV[5])

local acked = ack_each(cjson.decode(acks))
return {acked, claim_ahead(now, deadline, owner, limit)}
