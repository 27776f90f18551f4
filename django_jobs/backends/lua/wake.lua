-- Wake a job parked on a limit: delayed -> ready now (1). Returns 2 when it is leased or ready
-- already (on its way to look for room itself), 0 when it is not in this queue any more.
local id = ARGV[1]

if redis.call('ZREM', delayed_key, id) == 1 then
  ready(id)
  return 1
end
if redis.call('ZSCORE', processing_key, id) or redis.call('ZSCORE', waiting_key, id) then return 2 end
return 0
