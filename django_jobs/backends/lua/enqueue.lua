-- Store one message (common.lua's store): id, body, priority, due (ms), now (ms).
store(ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]))
return 1
