-- prune: delete the keys of a gate that has been idle for long, so the coordinator can drop it
-- from the registry (fg:gates lives outside the gate's slot: the SREM is the caller's separate
-- command after this script said yes). Run by the leader on gates that are not in its config.
-- KEYS: 1 the gate's base name (see lib_gate.lua)
-- ARGV: 1 epoch of the caller (fenced like the target: a deposed leader deletes nothing of a
--         gate its successor publishes)  2 idle_after_ms
-- Returns {state, idle_ms}: state ST.PRUNED (1) = pruned (keys deleted), ST.IDLE (2) = idle for
--   idle_ms so far, ST.IN_USE (0) = in use, ST.PRUNE_REFUSED (-1) = refused (a newer epoch owns
--   the gate).
-- Idle = no holders, no waiters, no lanes (expired entries included: nothing of a gate with
-- holders or waiters is ever deleted), no live pod (the heartbeats fill fg:{G}:pods), no live
-- target, and no acquire since the last check (the sequence counter and the grant/reject
-- counters unchanged). The start of the idle period and the activity mark it saw are kept in
-- the util hash (idle_since, idle_mark); any activity restarts the period. The per-pod wake
-- lists expire by themselves. A client that uses the gate again registers it again.
local epoch, idle_after = num(ARGV[1], 0), num(ARGV[2], nil)
local now = now_ms()
local stored = num(redis.call('HGET', K_TARGET, 'epoch'), nil)
if stored and epoch < stored then return {ST.PRUNE_REFUSED, 0} end

check_schema(redis.call('HGET', K_CFG, 'schema'))
local busy = redis.call('ZCARD', K_HOLDERS) > 0 or redis.call('ZCARD', K_LANES) > 0
  or redis.call('ZCARD', K_WAITERS) > 0
  or redis.call('ZCOUNT', K_PODS, '(' .. now, '+inf') > 0
if not busy then
  local t = redis.call('HMGET', K_TARGET, 'value', 'expires_at')
  busy = num(t[1], nil) ~= nil and num(t[2], 0) > now
end
adm_flush()  -- (a gate converted by check_schema)
if busy then
  redis.call('HDEL', K_UTIL, 'idle_since', 'idle_mark')
  return {ST.IN_USE, 0}
end

local s = redis.call('HMGET', K_STATS, STAT.GRANTED, STAT.REJECTED, STAT.PARKED)
local mark = table.concat({redis.call('GET', K_SEQ) or '0', s[1] or '0', s[2] or '0',
  s[3] or '0'}, ':')
local seen = redis.call('HMGET', K_UTIL, 'idle_since', 'idle_mark')
local since = num(seen[1], nil)
if since == nil or seen[2] ~= mark or since > now then
  redis.call('HSET', K_UTIL, 'idle_since', now, 'idle_mark', mark)
  return {ST.IDLE, 0}
end
if idle_after == nil or now - since < idle_after then return {ST.IDLE, now - since} end
redis.call('DEL', K_CFG, K_TARGET, K_HOLDERS, K_QUEUE, K_WAITERS, K_SEQ, K_STATS, K_PODS, K_UTIL,
  K_LANES, K_FAIR, K_BIG, K_ADM, K_TW, K_EVICTED, K_OBS)
return {ST.PRUNED, now - since}
