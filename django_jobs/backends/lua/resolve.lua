-- A parent of a blocked message of this queue finished with `outcome`: that edge is resolved.
-- Once the last one is, the message is ready (or delayed until its own due time). A failed or
-- cancelled parent settles it the same way at once (failed: kept for audit; cancelled:
-- forgotten), unless its envelope says run_if_parent_fails. A parent already resolved, or a
-- message no longer blocked, changes nothing: a replay is harmless.
-- Returns {'none'}, {'waiting'}, {'ready'}, or {outcome, body, settled's flag} when it settled
-- the message ('failed' or 'cancelled').
local id = ARGV[1]
local parent = ARGV[2]
local outcome = ARGV[3]         -- 'completed' | 'failed' | 'cancelled'
local now = tonumber(ARGV[4])   -- ms
local reason = ARGV[5]          -- the last error of a message it settles

local raw = redis.call('HGET', blocked_key, id)
if not raw then return {'none'} end
local left = without(raw, cjson.encode(parent))
if not left then return {'none'} end
local function still_blocked()
  redis.call('HSET', blocked_key, id, left)
  return {'waiting'}
end
local failed = outcome ~= 'completed'
if not failed and left ~= '[]' then return still_blocked() end  -- the usual case: its body is not read
local body = redis.call('HGET', bodies_key, id)
if not body then  -- its body was purged by hand: nothing left to run or settle
  redis.call('HDEL', blocked_key, id)
  return {'none'}
end
local decoded, envelope = pcall(cjson.decode, body)  -- not decodable: the worker rejects it
if not decoded or type(envelope) ~= 'table' then envelope = {} end
local options = type(envelope.options) == 'table' and envelope.options or {}

if failed and options.run_if_parent_fails ~= true then
  redis.call('HDEL', blocked_key, id)
  if outcome == 'failed' then
    fail(id, now, reason)
  else
    forget(id)
  end
  return {outcome, body, settled(id, outcome)}
end
if left ~= '[]' then return still_blocked() end
redis.call('HDEL', blocked_key, id)
local due = type(envelope.available_at) == 'number' and math.floor(envelope.available_at * 1000) or 0
requeue(id, due, now)
return {'ready'}
