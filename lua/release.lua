-- release: give a lease back and hand the freed slot to the head waiter in the same call.
-- KEYS: the gate keys (see lib.lua)
-- ARGV: 1 lease id
-- Returns {released, limit}: released = 1 if this id held a lease, 0 if it was already gone
--   (double release, or expired and reaped): then nothing of anyone else's is freed.
local now = now_ms()
local cfg = load_cfg()
local released = redis.call('ZREM', K_HOLDERS, ARGV[1])
if released == 1 then redis.call('HINCRBY', K_STATS, 'released', 1) end
local lim = settle(now, cfg)
return {released, lim}
