-- Every edge of a settled parent listed in `children` is resolved: the parent leaves the outbox
-- and forgets those children (a parent dispatched again since keeps the ones attached to it
-- meanwhile).
local parent = ARGV[1]
local children = ARGV[2]        -- JSON: [child id, ...]

redis.call('HDEL', finished_key, parent)
local raw = redis.call('HGET', dependents_key, parent)
if not raw then return 1 end
local done = {}
for _, child in ipairs(cjson.decode(children)) do done[child] = true end
local kept = {}
for _, edge in ipairs(cjson.decode(raw)) do
  if not done[edge[1]] then table.insert(kept, edge) end
end
if #kept == 0 then
  redis.call('HDEL', dependents_key, parent)
else
  redis.call('HSET', dependents_key, parent, cjson.encode(kept))
end
return 1
