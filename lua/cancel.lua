-- cancel: leave the wait list, or give the permit back if a hand-off raced in first.
-- KEYS: 1 the gate's base name (see lib_gate.lua)
-- ARGV: 1 lease id  2 its waiter member ('<tenant>}<R>}<seq20>}<id>', '' if it never parked)
-- Returns {outcome, limit}: 1 = left the wait list (no permit consumed), 2 = had been granted
--   and is now released, 0 = unknown id (already expired, cancelled or released).
local id, member = ARGV[1], ARGV[2] or ''
local now = now_ms()
local cfg = load_cfg(now)
local outcome = 0
if member ~= '' and redis.call('ZSCORE', K_WAITERS, member) then
  remove_waiters({member})
  redis.call('HINCRBY', K_STATS, 'cancelled', 1)
  outcome = 1
elseif remove_leases({id}, 1, 1) == 1 then
  redis.call('HINCRBY', K_STATS, 'released', 1)
  outcome = 2
end
local lim = settle(now, cfg)
return {outcome, lim}
