-- ARGV: id, owner.
if not owned(ARGV[1], ARGV[2]) then return 0 end
forget(ARGV[1])
return 1
