-- Settle many leased messages for good: one flag per pair, 1 acked or 0 lost (fenced off:
-- left alone).
local acks = ARGV[1]            -- JSON: [[id, owner], ...]

return ack_each(cjson.decode(acks))
