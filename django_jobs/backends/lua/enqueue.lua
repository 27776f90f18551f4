-- Store one message (common.lua's store) and make it ready, or delayed until due.
local id = ARGV[1]
local body = ARGV[2]
local priority = ARGV[3]
local due = tonumber(ARGV[4])   -- ms
local now = tonumber(ARGV[5])   -- ms

store(id, body, priority, due, now)
return 1
