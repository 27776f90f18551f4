-- Attach a blocked child (of any queue) to a parent of this queue, once however often it is
-- asked. Returns 'attached' while the parent is live here (its body kept, not failed); else
-- its outcome while it waits in the outbox, 'failed' while it is kept as failed, or 'gone'
-- when this queue does not hold it.
local parent = ARGV[1]
local child = ARGV[2]
local child_queue = ARGV[3]

local failed = redis.call('ZSCORE', failed_key, parent)
if redis.call('HEXISTS', bodies_key, parent) == 1 and not failed then
  local raw = redis.call('HGET', dependents_key, parent)
  local children = raw and cjson.decode(raw) or {}
  for _, edge in ipairs(children) do
    if edge[1] == child then return 'attached' end
  end
  table.insert(children, {child, child_queue})
  redis.call('HSET', dependents_key, parent, cjson.encode(children))
  return 'attached'
end
local outcome = redis.call('HGET', finished_key, parent)
if outcome then return outcome end
if failed then return 'failed' end
return 'gone'
