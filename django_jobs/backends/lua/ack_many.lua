-- Settle many leased messages: ack `acks` for good (ack_each's flags: 0 lost, fenced off and
-- left alone) and requeue the failed runs of `requeues` (requeue_each's replies). Then the runs
-- of `begun`, claimed ahead, have started: no longer claimed ahead, so a loss of one counts as
-- a run from now on (a lost one is left alone). Returns {ack flags, requeue replies}.
local acks = ARGV[1]            -- JSON: [[id, owner], ...]
local begun = ARGV[2]           -- JSON: [[id, owner], ...]
local requeues = ARGV[3]        -- JSON: [[id, owner, body, due ms, error], ...]
local now = tonumber(ARGV[4])   -- ms

for _, pair in ipairs(cjson.decode(begun)) do
  if owned(pair[1], pair[2]) then redis.call('HDEL', ahead_key, pair[1]) end
end
local requeued = requeue_each(cjson.decode(requeues), now)
return {ack_each(cjson.decode(acks)), requeued}
