-- adopt: count as leases the permits a pod granted itself while Redis was unreachable (under the
-- local fair-share bound), plus its leases that Redis lost meanwhile (a restart), so the fleet cap
-- accounts for work that is still running when Redis returns. The limit is not checked: the work
-- already runs; new grants simply wait until units held < limit again.
-- KEYS: 1 the gate's base name (see lib_gate.lua)
-- ARGV: 1 fence_ms (the recovery fence of a gate found without state: lib_fence.lua gate_birth;
--       the adopted work is what it waits for), 2 max_token (the highest fencing token among
--       the pod's leases; the gate's counter is raised above it), then the lease ids (their
--       weights and tokens in them, as ever).
-- Returns {added, expires_at}: the number of ids added and the server time they now expire at.
-- Ids still held are renewed (GT never shortens a lease): the client adopts twice around a short
-- pause before fleet mode resumes (Fleet._probe_loop), and the heartbeat is paused until then,
-- so a lease adopted by the first pass must not lapse.
local now = now_ms()
local cfg = load_cfg(now)
gate_birth(now, cfg, num(ARGV[1], 0))
reap(now)
raise_seq(num(ARGV[2], 0))
local expires = now + cfg.lease_ms
local added = 0
for i = 3, #ARGV do
  if redis.call('ZSCORE', K_HOLDERS, ARGV[i]) == false then count_again(ARGV[i]) end
  added = added + redis.call('ZADD', K_HOLDERS, 'GT', expires, ARGV[i])
end
if added > 0 then redis.call('HINCRBY', K_STATS, 'adopted', added) end
adm_flush()
return {added, expires}
