-- A parent of a blocked message of this queue finished with `outcome`: that edge is resolved.
-- Once none is open, the message is ready (or delayed until its own due time). A failed or
-- cancelled parent settles it the same way at once (failed: kept for audit; cancelled:
-- forgotten), unless its envelope says run_if_parent_fails. An edge already resolved, or a
-- message no longer blocked, changes nothing: a replay is harmless.
-- Returns {'none'}, {'waiting'}, {'ready'}, or {outcome, body, settled's flag} when it settled
-- the message ('failed' or 'cancelled').
local id = ARGV[1]
local parent = ARGV[2]
local outcome = ARGV[3]         -- 'completed' | 'failed' | 'cancelled'
local now = tonumber(ARGV[4])   -- ms
local reason = ARGV[5]          -- the last error of a message it settles

if redis.call('HEXISTS', blocked_key, id) == 0 then return {'none'} end
if redis.call('ZREM', edges_key, id .. '\0' .. parent) == 0 then return {'none'} end
local failed = outcome ~= 'completed'
local open = redis.call('ZLEXCOUNT', edges_key, lex_from(id), lex_to(id))
if not failed and open > 0 then return {'waiting'} end  -- the usual case: its body is not read
local body = redis.call('HGET', bodies_key, id)
if not body then  -- its body was purged by hand: nothing left to run or settle
  unblock(id)
  return {'none'}
end
local decoded, envelope = pcall(cjson.decode, body)  -- not decodable: the worker rejects it
if not decoded or type(envelope) ~= 'table' then envelope = {} end
local options = type(envelope.options) == 'table' and envelope.options or {}

if failed and options.run_if_parent_fails ~= true then
  unblock(id)
  if outcome == 'failed' then
    fail(id, now, reason)
  else
    forget(id)
  end
  return {outcome, body, settled(id, outcome)}
end
if open > 0 then return {'waiting'} end
redis.call('HDEL', blocked_key, id)
local due = type(envelope.available_at) == 'number' and math.floor(envelope.available_at * 1000) or 0
requeue(id, due, now)
return {'ready'}
