-- The heartbeat transition of one gate, shared by heartbeat.lua (one gate per call) and
-- heartbeat_many.lua (several gates of one pod, one slot, per call); fleetgate.scripts prepends
-- it, after the shared library (lib_*.lua), to those two scripts only. A = the gate's ARGV
-- (heartbeat.lua's ARGV); the gate's keys are lib_gate.lua's K_* (heartbeat_many.lua points
-- them at each gate in turn).
-- Returns heartbeat.lua's reply (see there). Waiters are named by their waiter member
-- ('<tenant>}<R>}<seq20>}<id>'); the reply names ids.
--
-- A lease missing from the holders (or left with an older expiry) although the pod saw it
-- renewed to a time still ahead did not expire: the gate lost it (a restart, a lossy failover,
-- a deleted key) while the work still runs. It is counted again ("adopted"), so the fleet cap
-- accounts for it; a lease whose renewal time has passed is reported lost and never revived.
-- Renew id's lease to r.expiry if it still holds an unexpired one; one that expired is removed,
-- never revived, unless the pod knows it was renewed to a time still ahead (known > now): then
-- it is counted again (its weight and tokens too, before it is added) and listed in r.adopted.
-- Returns whether id holds a lease now.
local function renew_lease(id, known, now, r)
  local expiry = tonumber(redis.call('ZSCORE', K_HOLDERS, id))
  if expiry == nil or expiry <= now then
    -- an id resized meanwhile lives on under its new id (resize.lua): never counted again
    if known > now and not (expiry == nil and redis.call('ZSCORE', K_EVICTED, id .. '=r')) then
      r.adopted[#r.adopted + 1] = id
      if expiry == nil then count_again(id) end
    else
      if expiry ~= nil then
        remove_leases({id}, 1, 1)
        redis.call('HINCRBY', K_STATS, 'expired_leases', 1)
      end
      return false
    end
  end
  redis.call('ZADD', K_HOLDERS, r.expiry, id)
  return true
end

-- The pod's n waiters, from A[i] on as (member, ms it may still wait) pairs: one still in the
-- wait list has its entry renewed, unless by the drain it would now start after its deadline:
-- then it leaves (r.too_late, its estimate in r.too_late_ms and r.too_late_hold_ms: its expected
-- start and the band's hold its deadline had to cover too; deadline-aware admission,
-- lib_drain.lua late_waiter); one granted while the pod missed the wake holds its lease
-- now (r.granted); else it was evicted by a higher band ('<id>' in evicted: r.evicted),
-- refused as heavier than the ceiling ('<id>=c': r.too_heavy), or lost (r.lost_waiters).
local function renew_waiters(A, i, n, now, cfg, r)
  local late, seen = {}, {}
  local queued = 0
  if n > 0 and cfg.deadline_admission then queued = redis.call('ZCARD', K_WAITERS) end
  for _ = 1, n do
    local member, remaining = A[i], tonumber(A[i + 1])
    local id = member_id(member)
    i = i + 2
    if redis.call('ZSCORE', K_WAITERS, member) then
      local start, hold = late_waiter(now, cfg, member, remaining, queued, seen)
      if start then
        late[#late + 1] = member
        r.too_late[#r.too_late + 1] = id
        r.too_late_ms[#r.too_late_ms + 1] = start
        r.too_late_hold_ms[#r.too_late_hold_ms + 1] = cfg.deadline_finish and hold or -1
      else
        redis.call('ZADD', K_WAITERS, now + math.min(cfg.waiter_ms, remaining), member)
      end
    elseif renew_lease(id, 0, now, r) then
      r.granted[#r.granted + 1] = id
    else
      local gone = redis.call('ZMSCORE', K_EVICTED, id, id .. '=c')
      if gone[1] then
        r.evicted[#r.evicted + 1] = id
      elseif gone[2] then
        r.too_heavy[#r.too_heavy + 1] = id
      else
        r.lost_waiters[#r.lost_waiters + 1] = id
      end
    end
  end
  if #late > 0 then
    remove_waiters(late)
    redis.call('HINCRBY', K_STATS, 'too_late', #late)
  end
end

local function heartbeat_gate(A)
  local pod, pod_ttl = A[1], tonumber(A[2])
  local n_leases = tonumber(A[3])
  local i_waiters = 4 + 2 * n_leases
  local n_waiters = tonumber(A[i_waiters])
  local i_tail = i_waiters + 1 + 2 * n_waiters
  local max_token = num(A[i_tail], 0)
  local now = now_ms()
  -- A pod's defaults are registered on a gate without configuration, as its first acquire
  -- would: an idle pod's gate -- never called yet, or wiped by an empty restart -- shows its
  -- settings (`fleetgate status`) instead of those of a gate nobody configured. The sweep (no
  -- pod, no defaults) registers nothing.
  local d = {}
  for j = 1, 13 do d[j] = A[i_tail + 1 + j] end
  local cfg = load_cfg(now, d, pod ~= '' and d[1] ~= nil)
  -- before anything is renewed or counted again: this pod's own leases, adopted below, are
  -- work the fence waits for
  gate_birth(now, cfg, num(A[i_tail + 1], 0))
  reap(now)
  -- heads heavier than the ceiling (lowered while they waited in big) are refused first, so
  -- this pod's own are reported in this reply (too_heavy)
  refuse_big(now, cfg)

  local r = {expiry = now + cfg.lease_ms, lost = {}, granted = {}, lost_waiters = {},
             adopted = {}, evicted = {}, too_heavy = {}, too_late = {}, too_late_ms = {},
             too_late_hold_ms = {}, revoked = {}}
  local held = {}  -- the pod's leases held now, in the order sent (newest first)
  for i = 4, i_waiters - 1, 2 do
    if renew_lease(A[i], num(A[i + 1], 0), now, r) then
      held[#held + 1] = A[i]
    else
      r.lost[#r.lost + 1] = A[i]
    end
  end
  renew_waiters(A, i_waiters + 1, n_waiters, now, cfg, r)
  if #r.adopted > 0 then redis.call('HINCRBY', K_STATS, 'adopted', #r.adopted) end
  raise_seq(max_token)
  -- A grant whose wake this pod missed gets its fencing token now: a fresh one, above every
  -- token issued before the pod learns of its grant (it cannot have used the permit earlier).
  local tokens = {}
  if #r.granted > 0 then
    local first = next_tokens(now, #r.granted)
    for k = 1, #r.granted do tokens[k] = first + k - 1 end
  end

  local pod_new = 0
  if pod ~= '' then pod_new = redis.call('ZADD', K_PODS, now + pod_ttl, pod) end
  redis.call('ZREMRANGEBYSCORE', K_PODS, '-inf', now)
  local live = redis.call('ZCARD', K_PODS)
  local lim = current_limit(now, cfg)
  readmit(lim, cfg.tlim)
  handoff(now, cfg, lim)
  -- revocation (lib_revoke.lua): what the head still lacks after the hand-off, then this pod's
  -- answer to it
  local waiting = redis.call('ZCARD', K_WAITERS)
  revoke_demand(now, cfg, lim, waiting)
  revoke_leases(now, cfg, held, r)
  adm_flush()
  return {lim, live, r.lost, r.granted, r.lost_waiters, waiting, units_held(), cfg.lease_ms,
    cfg.waiter_ms, r.expiry, pod_new, r.adopted, tokens, r.evicted, r.too_heavy, cfg.ceiling,
    cfg.tlim or -1, cfg.tlim and tokens_held() or 0, r.too_late, r.too_late_ms,
    r.too_late_hold_ms, r.revoked}
end
