-- Store many messages of one queue (common.lua's store): ARGV[1] is now (ms), then id, body,
-- priority and due (ms) of each message in turn. Returns how many it stored.
local now = tonumber(ARGV[1])
for i = 2, #ARGV, 4 do
  store(ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]), now)
end
return (#ARGV - 1) / 4
