-- Shared library (lib_*.lua, see lib_gate.lua): reaping expired leases, waiters, evictions.

-- Expired entries removed per call, per kind. A bound keeps every call O(log n) even after a
-- mass crash; the coordinator's reaper and every later call sweep the rest.
local REAP_MAX = 64

-- Remove up to REAP_MAX expired leases; returns the units and the tokens freed. Called where
-- they matter: by an acquire that finds the gate full, and by every heartbeat and sweep (so an
-- expired lease of a gate below its limit, which blocks nobody, goes within a heartbeat period).
local function reap_leases(now)
  local leases = redis.call('ZRANGEBYSCORE', K_HOLDERS, '-inf', now, 'LIMIT', 0, REAP_MAX)
  if #leases == 0 then return 0, 0 end
  local n, units, tokens = remove_leases(leases, 1, #leases)
  redis.call('HINCRBY', K_STATS, 'expired_leases', n)
  return units, tokens
end

-- Remove up to REAP_MAX expired waiters; returns how many. Called by an acquire that finds the
-- wait list full, and by every heartbeat and sweep; a dead head is also dropped by handoff.
local function reap_waiters(now)
  local waiters = redis.call('ZRANGEBYSCORE', K_WAITERS, '-inf', now, 'LIMIT', 0, REAP_MAX)
  if #waiters > 0 then
    remove_waiters(waiters)
    redis.call('HINCRBY', K_STATS, 'abandoned_waiters', #waiters)
  end
  return #waiters
end

-- Evictions are remembered this long (x waiter_ms) so a pod that missed the wake learns of it
-- from its heartbeat (an evicted waiter gets Overloaded, never parks again by itself).
-- Read first, written only when there is something to remove: a script's first write decides
-- whether Redis refuses it under maxmemory (OOM), and a removal that always ran would let every
-- later write of the script through (tests/client/test_fallback.py, the "oom" case).
local function reap_evicted(now)
  local gone = redis.call('ZRANGEBYSCORE', K_EVICTED, '-inf', now, 'LIMIT', 0, REAP_MAX)
  if #gone > 0 then redis.call('ZREM', K_EVICTED, unpack(gone)) end
end

local function reap(now)
  reap_leases(now)
  reap_waiters(now)
  reap_evicted(now)
end
