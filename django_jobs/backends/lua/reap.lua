-- Recover one expired lease. Claimed ahead (maybe never started): back to waiting as it was,
-- not a run, marked '2' so its next claim ahead must begin; returns 2. Else a lost run
-- (`action`): requeue it (retries left), marked '2' too (a job that crashes its worker within an
-- ack interval of every start has each later crash counted), or fail it; returns 1, or 3 when it
-- failed and messages depend on it (its outcome is in the outbox: see settled).
-- A message asked to abort is neither: it is forgotten (cancelled); returns {who asked, 1 if a
-- run was lost or 0 if it was only claimed ahead, settled's flag}.
-- Acts only if the same lease is still held and still expired: a heartbeat or a settle that
-- happened since the listing wins (returns 0).
local id = ARGV[1]
local owner = ARGV[2]           -- the owner seen when listing
local now = tonumber(ARGV[3])   -- ms
local action = ARGV[4]          -- 'retry' | 'fail' (unused when claimed ahead)
local body = ARGV[5]            -- empty: keep the stored body
local due = tonumber(ARGV[6])   -- ms
local last_error = ARGV[7]

local deadline = redis.call('ZSCORE', processing_key, id)
if redis.call('HGET', owners_key, id) ~= owner or not deadline or tonumber(deadline) > now then return 0 end
local ahead = redis.call('HGET', ahead_key, id)
local aborted_by = redis.call('HGET', aborts_key, id)
if aborted_by then
  forget(id)
  return {aborted_by, ahead and 0 or 1, settled(id, 'cancelled')}
end
release(id)
if ahead then
  redis.call('HSET', ahead_key, id, '2')
  ready(id)
  return 2
end
if body ~= '' then redis.call('HSET', bodies_key, id, body) end
if action == 'retry' then
  redis.call('HSET', errors_key, id, last_error)
  redis.call('HSET', ahead_key, id, '2')
  requeue(id, due, now)
else
  fail(id, now, last_error)
  if settled(id, 'failed') == 2 then return 3 end
end
return 1
