-- Settle many leased messages for good: one flag per pair, as ack_each gives it (0: lost,
-- fenced off and left alone). Then the runs of `begun`, claimed ahead, have started: no longer
-- claimed ahead, so a loss of one counts as a run from now on (a lost one is left alone).
local acks = ARGV[1]            -- JSON: [[id, owner], ...]
local begun = ARGV[2]           -- JSON: [[id, owner], ...]

for _, pair in ipairs(cjson.decode(begun)) do
  if owned(pair[1], pair[2]) then redis.call('HDEL', ahead_key, pair[1]) end
end
return ack_each(cjson.decode(acks))
