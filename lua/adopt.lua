-- adopt: count as leases the permits a pod granted itself while Redis was unreachable (under the
-- local fair-share bound), and keep counting its fleet leases, so the fleet cap accounts for work
-- that is still running when Redis returns. The limit is not checked: the work already runs; new
-- grants simply wait until units held < limit again.
-- KEYS: 1 the gate's base name (see lib_gate.lua)
-- ARGV: 1 fence_ms (the recovery fence of a gate found without state: lib_fence.lua gate_birth;
--       the adopted work is what it waits for), 2 max_token (the highest fencing token among
--       the pod's leases; the gate's counter is raised above it), 3 n, then n local ids (granted
--       under the fallback: always counted), then the fleet leases as (id, server-ms expiry the
--       pod last saw it renewed to) pairs. Ids carry their weights and tokens, as ever.
-- Returns {added, expires_at, lapsed}: the number of ids added, the server time they now expire
-- at, and the fleet lease ids that lapsed (not counted again: their holders are told).
-- A fleet lease still in the holders is kept, expired or not: nothing reaped it, so nobody took
-- its units (Redis refused writes meanwhile, say). One missing although its renewal time is
-- still ahead was lost by the gate (a restart) while its work runs: counted again, as the
-- heartbeat does (heartbeat_lib.lua). One missing whose renewal time has passed was reaped and
-- its units may have gone to another pod: it lapsed, unless the gate's recovery fence holds
-- (state lost, nothing granted since). So leases are not reaped here: a pod still to adopt keeps
-- its unrenewed ones. Ids still held are renewed (GT never shortens a lease): the client adopts
-- around a short pause before fleet mode resumes (client/_fallback.py), and the heartbeat is
-- paused until then, so a lease adopted by the first pass must not lapse.
local now = now_ms()
local cfg = load_cfg(now)
gate_birth(now, cfg, num(ARGV[1], 0))
reap_waiters(now)
reap_evicted(now)
raise_seq(num(ARGV[2], 0))
local fenced = cfg.fence > now
local expires = now + cfg.lease_ms
local n_local = num(ARGV[3], 0)
local added, lapsed = 0, {}
local function adopt_id(id)
  if redis.call('ZSCORE', K_HOLDERS, id) == false then count_again(id) end
  added = added + redis.call('ZADD', K_HOLDERS, 'GT', expires, id)
end
for i = 4, 3 + n_local do adopt_id(ARGV[i]) end
for i = 4 + n_local, #ARGV - 1, 2 do
  local id, known = ARGV[i], num(ARGV[i + 1], 0)
  if redis.call('ZSCORE', K_HOLDERS, id) ~= false then
    adopt_id(id)
  elseif (known > now or fenced) and not redis.call('ZSCORE', K_EVICTED, id .. '=r') then
    adopt_id(id)  -- (an id resized meanwhile lives on under its new id: never counted again)
  else
    lapsed[#lapsed + 1] = id
  end
end
if added > 0 then redis.call('HINCRBY', K_STATS, 'adopted', added) end
adm_flush()
return {added, expires, lapsed}
