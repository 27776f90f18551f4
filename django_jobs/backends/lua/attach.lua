-- Attach blocked children (of any queue) to parents of this queue, each once however often it is
-- asked. One reply per edge, in order: 'attached' while the parent is live here (its body kept,
-- not failed); else its outcome while it waits in the outbox, 'failed' while it is kept as
-- failed, or 'gone' when this queue does not hold it.
local edges = ARGV[1]           -- JSON: [[parent id, child id, child queue], ...]

local function attach(parent, child, child_queue)
  local failed = redis.call('ZSCORE', failed_key, parent)
  if redis.call('HEXISTS', bodies_key, parent) == 1 and not failed then
    redis.call('ZADD', dependents_key, 0, parent .. '\0' .. child .. '\0' .. child_queue)
    return 'attached'
  end
  local outcome = redis.call('HGET', finished_key, parent)
  if outcome then return outcome end
  if failed then return 'failed' end
  return 'gone'
end

local said = {}
for _, edge in ipairs(cjson.decode(edges)) do
  table.insert(said, attach(edge[1], edge[2], edge[3]))
end
return said
