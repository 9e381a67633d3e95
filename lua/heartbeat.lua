-- heartbeat: renew one pod's leases and waiters of one gate in one call, report what it lost and
-- which of its waiters were granted (recovers lost wake-ups), and register the pod as live.
-- An empty pod id renews nothing and only sweeps (the coordinator's reaper uses it).
-- KEYS: the gate keys (see lib.lua)
-- ARGV: 1 pod id  2 pod_ttl_ms  3 n_leases  then n_leases pairs (lease id, expires_at: the
--       server time (ms) the pod last saw this lease renewed to, 0 if unknown),
--       then n_waiters, then n_waiters pairs (waiter id, remaining deadline ms),
--       then optional: max_token (the highest fencing token the pod holds), and the pod's
--       defaults (floor, ceiling, max_queued, lease_ms, waiter_ms) for a gate whose
--       configuration is gone (read, never registered here).
-- Returns {limit, live_pods, lost_leases, granted_waiters, lost_waiters, queued, holders,
--   lease_ms, waiter_ms, expires_at, pod_new, adopted}: the TTLs in force (the client paces its
--   heartbeat by them), the server time renewed leases now expire at, pod_new = 1 when this
--   pod's entry had to be created (first registration, or the entry expired or was wiped), and
--   the ids counted again because the gate had lost them before they could expire (below).
--
-- A lease missing from the holders (or left with an older expiry) although the pod saw it
-- renewed to a time still ahead did not expire: the gate lost it (a restart, a lossy failover,
-- a deleted key) while the work still runs. It is counted again ("adopted"), so the fleet cap
-- accounts for it; a lease whose renewal time has passed is reported lost and never revived.
local pod, pod_ttl = ARGV[1], tonumber(ARGV[2])
local n_leases = tonumber(ARGV[3])
local i_waiters = 4 + 2 * n_leases
local n_waiters = tonumber(ARGV[i_waiters])
local i_tail = i_waiters + 1 + 2 * n_waiters
local max_token = num(ARGV[i_tail], 0)
local now = now_ms()
local cfg = load_cfg({ARGV[i_tail + 1], ARGV[i_tail + 2], ARGV[i_tail + 3], ARGV[i_tail + 4],
  ARGV[i_tail + 5]})
reap(now)

local lease_expiry = now + cfg.lease_ms
local lost, granted, lost_waiters, adopted = {}, {}, {}, {}
-- Renew id's lease if it still holds an unexpired one; one that expired is removed, never
-- revived, unless the pod knows it was renewed to a time still ahead (known > now).
local function renew(id, known)
  local expiry = tonumber(redis.call('ZSCORE', K_HOLDERS, id))
  if expiry == nil or expiry <= now then
    if known > now then
      adopted[#adopted + 1] = id
    else
      if expiry ~= nil then
        redis.call('ZREM', K_HOLDERS, id)
        redis.call('HINCRBY', K_STATS, 'expired_leases', 1)
      end
      return false
    end
  end
  redis.call('ZADD', K_HOLDERS, lease_expiry, id)
  return true
end

local i = 4
for _ = 1, n_leases do
  if not renew(ARGV[i], num(ARGV[i + 1], 0)) then lost[#lost + 1] = ARGV[i] end
  i = i + 2
end
i = i_waiters + 1
for _ = 1, n_waiters do
  local id, remaining = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  if redis.call('ZSCORE', K_QUEUE, id) then
    redis.call('ZADD', K_WAITERS, now + math.min(cfg.waiter_ms, remaining), id)
  elseif renew(id, 0) then
    granted[#granted + 1] = id
  else
    lost_waiters[#lost_waiters + 1] = id
  end
end
if #adopted > 0 then redis.call('HINCRBY', K_STATS, 'adopted', #adopted) end
raise_seq(max_token)

local pod_new = 0
if pod ~= '' then pod_new = redis.call('ZADD', K_PODS, now + pod_ttl, pod) end
redis.call('ZREMRANGEBYSCORE', K_PODS, '-inf', now)
local live = redis.call('ZCARD', K_PODS)
local lim = current_limit(now, cfg)
handoff(now, cfg, lim)
return {lim, live, lost, granted, lost_waiters,
  redis.call('ZCARD', K_QUEUE), redis.call('ZCARD', K_HOLDERS), cfg.lease_ms, cfg.waiter_ms,
  lease_expiry, pod_new, adopted}
