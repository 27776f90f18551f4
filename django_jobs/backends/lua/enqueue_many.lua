-- Store many messages of one queue (common.lua's store), each ready or delayed until due.
-- The arguments after `now` are the id, body, priority and due time (ms) of each message in turn.
local now = tonumber(ARGV[1])   -- ms
local messages = ARGV

for i = 2, #messages, 4 do
  store(messages[i], messages[i + 1], messages[i + 2], tonumber(messages[i + 3]), now)
end
return (#messages - 1) / 4
