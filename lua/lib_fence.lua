-- Shared library (lib_*.lua, see lib_gate.lua): what a gate may grant now -- the recovery
-- fence of a gate found without state (gate_birth) and the limit in force (current_limit).

-- The recovery fence. A gate found without state (a Redis restarted empty, FLUSHALL, a new gate:
-- inside Redis the three look the same) may still have work running in pods that counted it in
-- the lost state: pods in the fair-share fallback adopt theirs when their probe succeeds, pods
-- that saw nothing count theirs again with their next heartbeat. Until they have, no grant is
-- made: the first client script that finds the state missing (acquire, heartbeat, adopt) marks
-- the gate born (cfg 'fence' present) and fences it for fence_ms, one registration period of
-- the calling pod (every pod with work beats its gates well within it): cfg 'fence' = the end.
-- Waiters park meanwhile and are handed off when it ends. The node key '<prefix>:born'
-- remembers when this server first held fleetgate state under the prefix: a gate born a fence
-- period after that is new, not wiped, and is not fenced ('fence' = the time it was born), so
-- only the first moments of an empty server (or a wiped one) pay, and a gate with state never
-- does: its 'fence' comes with the HMGET above, and the node key is read only here. On Cluster
-- a script reaches only its gate's slot, so the node key is out of reach (pcall) and every gate
-- found without state is fenced. fence_ms 0 (the coordinator's sweep, a fleet without a fence)
-- marks nothing. State left by a fleetgate without birth marks (holders or waiters present) is
-- marked born without a fence.
local function gate_birth(now, cfg, fence_ms)
  if cfg.born or fence_ms <= 0 then return end
  local until_ = now
  -- (live pods alone are no state: an idle pod without a fence registers itself on a wiped
  -- gate too, and the node key is left alone here: a gate's leftovers say nothing of the
  -- server's other gates)
  if redis.call('EXISTS', K_HOLDERS, K_WAITERS) == 0 then
    until_ = now + fence_ms
    local node_key = string.match(K_CFG, '^([^:]*):{') .. ':born'
    local first = redis.pcall('GET', node_key)
    if type(first) ~= 'table' then  -- a reply, not an error (Cluster: another slot)
      first = num(first, nil)
      if first == nil then
        first = now
        redis.pcall('SET', node_key, string.format('%.0f', now))
      end
      until_ = math.min(until_, first + fence_ms)
    end
  end
  cfg.born, cfg.fence = true, until_
  redis.call('HSET', K_CFG, 'fence', string.format('%.0f', math.max(until_, now)))
end

-- limit = the unexpired target, else floor; clamped to [floor, ceiling].
local function current_limit(now, cfg)
  local t = redis.call('HMGET', K_TARGET, 'value', 'expires_at')
  local lim = cfg.floor
  local value, expires_at = num(t[1], nil), num(t[2], nil)
  if value and expires_at and expires_at > now then lim = math.floor(value) end
  if lim < cfg.floor then lim = cfg.floor end
  if lim > cfg.ceiling then lim = cfg.ceiling end
  return lim
end
