-- set_target: publish the coordinator's target for a gate, fenced by the leader's epoch, and hand
-- any new room to the head waiters at once (and refuse the waiters heavier than the ceiling, as
-- every settle does: lib_handoff.lua refuse_heads).
-- KEYS: 1 the gate's base name (see lib_gate.lua)
-- ARGV: 1 value  2 epoch  3 ttl_ms (the target decays to the floor after it)
-- Returns {accepted, limit, stored_epoch, granted}: accepted = 0 when epoch < the stored epoch
--   (a deposed leader waking up cannot overwrite its successor).
local value, epoch, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local cfg = load_cfg(now)
local stored = num(redis.call('HGET', K_TARGET, 'epoch'), nil)
if stored and epoch < stored then
  return {0, current_limit(now, cfg), stored, 0}
end
redis.call('HSET', K_TARGET, 'value', value, 'epoch', epoch, 'expires_at', now + ttl)
local lim, granted = settle(now, cfg)
return {1, lim, epoch, granted}
