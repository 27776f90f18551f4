-- These edges of a settled parent are resolved (members of its dependents): they are forgotten,
-- and once it has no edge left, the parent leaves the outbox. Returns 1 while it has edges left
-- (the caller drains them next), else 0.
local parent = ARGV[1]
local members = ARGV[2]         -- JSON: [member, ...], at most a drain round's

for _, member in ipairs(cjson.decode(members)) do
  redis.call('ZREM', dependents_key, member)
end
if has_dependents(parent) then return 1 end
redis.call('HDEL', finished_key, parent)
return 0
