-- Settle many leased messages for good: one flag per pair, as ack_each gives it (0: lost,
-- fenced off and left alone).
local acks = ARGV[1]            -- JSON: [[id, owner], ...]

return ack_each(cjson.decode(acks))
