-- adopt: count as leases the permits a pod granted itself while Redis was unreachable (under the
-- local fair-share bound), plus its leases that Redis lost meanwhile (a restart), so the fleet cap
-- accounts for work that is still running when Redis returns. The limit is not checked: the work
-- already runs; new grants simply wait until in-flight < limit again.
-- KEYS: the gate keys (see lib.lua)
-- ARGV: lease ids held by the calling pod
-- Returns the number of ids added. Ids still held are renewed (GT never shortens a lease): the
-- client adopts twice around a short pause before fleet mode resumes (Fleet._probe_loop), and
-- the heartbeat is paused until then, so a lease adopted by the first pass must not lapse.
local now = now_ms()
local cfg = load_cfg()
reap(now)
local added = 0
for i = 1, #ARGV do
  added = added + redis.call('ZADD', K_HOLDERS, 'GT', now + cfg.lease_ms, ARGV[i])
end
if added > 0 then redis.call('HINCRBY', K_STATS, 'adopted', added) end
return added
