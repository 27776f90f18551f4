-- ARGV: id, owner seen when listing, now_ms, 'retry' | 'fail', body, due_ms, error.
-- Acts only if the same lease is still held and still expired: a heartbeat or a settle that
-- happened since the listing wins.
local id, now = ARGV[1], tonumber(ARGV[3])
local deadline = redis.call('ZSCORE', R, id)
if redis.call('HGET', O, id) ~= ARGV[2] or not deadline or tonumber(deadline) > now then return 0 end
release(id)
if ARGV[5] ~= '' then redis.call('HSET', B, id, ARGV[5]) end
if ARGV[4] == 'retry' then
  redis.call('HSET', E, id, ARGV[7])
  requeue(id, tonumber(ARGV[6]), now)
else
  fail(id, now, ARGV[7])
end
return 1
