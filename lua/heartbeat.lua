-- heartbeat: renew one pod's leases and waiters of one gate in one call, report what it lost and
-- which of its waiters were granted (recovers lost wake-ups), and register the pod as live.
-- An empty pod id renews nothing and only sweeps (the coordinator's reaper uses it).
-- KEYS: the gate keys (see lib.lua)
-- ARGV: 1 pod id  2 pod_ttl_ms  3 n_leases  then n_leases lease ids,
--       then n_waiters, then n_waiters pairs (waiter id, remaining deadline ms)
-- Returns {limit, live_pods, lost_leases, granted_waiters, lost_waiters, queued, holders,
--   lease_ms, waiter_ms} (the TTLs in force, so the client can pace its heartbeat)
local pod, pod_ttl = ARGV[1], tonumber(ARGV[2])
local now = now_ms()
local cfg = load_cfg()
reap(now)

local lease_expiry = now + cfg.lease_ms
-- Renew id's lease if it still holds an unexpired one; an expired one is removed, never revived.
local function renew(id)
  local expiry = tonumber(redis.call('ZSCORE', K_HOLDERS, id))
  if expiry == nil then return false end
  if expiry <= now then
    redis.call('ZREM', K_HOLDERS, id)
    redis.call('HINCRBY', K_STATS, 'expired_leases', 1)
    return false
  end
  redis.call('ZADD', K_HOLDERS, lease_expiry, id)
  return true
end

local lost, granted, lost_waiters = {}, {}, {}
local n_leases = tonumber(ARGV[3])
local i = 4
for _ = 1, n_leases do
  if not renew(ARGV[i]) then lost[#lost + 1] = ARGV[i] end
  i = i + 1
end
local n_waiters = tonumber(ARGV[i])
i = i + 1
for _ = 1, n_waiters do
  local id, remaining = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  if redis.call('ZSCORE', K_QUEUE, id) then
    redis.call('ZADD', K_WAITERS, now + math.min(cfg.waiter_ms, remaining), id)
  elseif renew(id) then
    granted[#granted + 1] = id
  else
    lost_waiters[#lost_waiters + 1] = id
  end
end

if pod ~= '' then redis.call('ZADD', K_PODS, now + pod_ttl, pod) end
redis.call('ZREMRANGEBYSCORE', K_PODS, '-inf', now)
local live = redis.call('ZCARD', K_PODS)
local lim = current_limit(now, cfg)
handoff(now, cfg, lim)
return {lim, live, lost, granted, lost_waiters,
  redis.call('ZCARD', K_QUEUE), redis.call('ZCARD', K_HOLDERS), cfg.lease_ms, cfg.waiter_ms}
