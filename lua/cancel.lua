-- cancel: leave the wait list, or give the permit back if a hand-off raced in first.
-- KEYS: 1 the gate's base name (see lib.lua)
-- ARGV: 1 waiter id
-- Returns {outcome, limit}: 1 = left the queue (no permit consumed), 2 = had been granted and is
--   now released, 0 = unknown id (already expired, cancelled or released).
local id = ARGV[1]
local now = now_ms()
local cfg = load_cfg()
local outcome = 0
if redis.call('ZREM', K_QUEUE, id) == 1 then
  redis.call('ZREM', K_WAITERS, id)
  redis.call('HINCRBY', K_STATS, 'cancelled', 1)
  outcome = 1
elseif redis.call('ZREM', K_HOLDERS, id) == 1 then
  redis.call('HINCRBY', K_STATS, 'released', 1)
  outcome = 2
end
local lim = settle(now, cfg)
return {outcome, lim}
