-- Settle a leased message as failed: kept in the failed set, with its error, for audit.
-- Returns 0 when fenced off, else settled's flag.
local id = ARGV[1]
local owner = ARGV[2]
local body = ARGV[3]            -- empty: keep the stored body
local now = tonumber(ARGV[4])   -- ms
local last_error = ARGV[5]

if not owned(id, owner) then return 0 end
release(id)
if body ~= '' then redis.call('HSET', bodies_key, id, body) end
fail(id, now, last_error)
return settled(id, 'failed')
