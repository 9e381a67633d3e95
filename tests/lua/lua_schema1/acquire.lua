-- acquire: release the leases given, then for each request, in order, grant a permit now, park
-- the caller at the tail of the FIFO wait list, or reject. One process sends what its callers
-- asked while its previous call was in flight as one call (fleetgate.client's group commit), so
-- the per-call costs (time, configuration, limit, counts, stats) are paid once per batch and the
-- entries go in with one ZADD per set; a caller that releases and acquires again costs one call.
-- KEYS: 1 the gate's base name (see lib.lua)
-- ARGV: 1 floor  2 ceiling  3 max_queued  4 lease_ms  5 waiter_ms  (defaults, registered only
--       when the gate has no configuration yet), 6 n = leases to release, then n lease ids,
--       then per request: id ('<pod>:<n>'), wait_ms (time the caller is willing to park, > 0)
-- Returns {limit, lease_ms, waiter_ms, released, then per request: status, token, n,
--   expires_at}: released = how many of the ids given held a lease (release.lua's reply);
--   status 1 = granted (n = holders), 2 = parked (n = position, 1-based), 0 = rejected because
--   the wait list is full (n = max_queued).
--   token is the fencing token: monotonic per gate in grant order (a parked caller's token is its
--   FIFO sequence number, and nobody barges past it).
--   lease_ms, waiter_ms: the TTLs in force, so the caller paces its first renewal by them.
--   expires_at: server time (ms) at which the granted lease (or the parked entry) expires.
-- Reaping is lazy (bounded, as ever): expired leases only when the gate is full, expired waiters
-- only when the wait list is full, i.e. when they could change the answer; heartbeats and the
-- coordinator's sweep reap the rest. Room while others wait (the limit grew, leases expired) goes
-- to them first.
local n_release = tonumber(ARGV[6])
local released = 0
if n_release > 0 then
  released = redis.call('ZREM', K_HOLDERS, unpack(ARGV, 7, 6 + n_release))
  if released > 0 then redis.call('HINCRBY', K_STATS, 'released', released) end
end
local first = 7 + n_release  -- ARGV index of the first request

local now = now_ms()
local cfg = load_cfg({ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]}, true)
local lim = current_limit(now, cfg)
local holders = redis.call('ZCARD', K_HOLDERS)
local queued = redis.call('ZCARD', K_QUEUE)
if holders >= lim then holders = holders - reap_leases(now) end
if queued > 0 and holders < lim then
  local granted, removed = handoff(now, cfg, lim, holders)
  holders, queued = holders + granted, queued - removed
end

-- Decide each request in order: 1 granted, 2 parked, 0 rejected (n: holders, position or
-- max_queued).
local status, n = {}, {}
local n_tokens, n_granted, n_parked, n_rejected = 0, 0, 0, 0
local waiters_reaped = false
for i = first, #ARGV, 2 do
  if queued == 0 and holders < lim then
    holders = holders + 1
    status[#status + 1], n[#n + 1] = 1, holders
    n_granted = n_granted + 1
  else
    if queued >= cfg.max_queued and not waiters_reaped then
      waiters_reaped = true
      queued = queued - reap_waiters(now)
    end
    if queued >= cfg.max_queued then
      status[#status + 1], n[#n + 1] = 0, cfg.max_queued
      n_rejected = n_rejected + 1
    else
      queued = queued + 1
      status[#status + 1], n[#n + 1] = 2, queued
      n_parked = n_parked + 1
    end
  end
end

-- Tokens in request order (a batch is one arrival instant; grants and parks keep their order),
-- then every new entry of a set in one ZADD.
local out = {lim, cfg.lease_ms, cfg.waiter_ms, released}
local token = 0
if n_granted + n_parked > 0 then token = next_tokens(now, n_granted + n_parked) end
local lease_expires = now + cfg.lease_ms
local held, queue, waiting = {}, {}, {}
for r, st in ipairs(status) do
  local id = ARGV[first + 2 * (r - 1)]
  local t, expires = 0, 0
  if st == 1 then
    t, expires = token, lease_expires
    held[#held + 1] = expires
    held[#held + 1] = id
  elseif st == 2 then
    t = token
    expires = now + math.min(cfg.waiter_ms, tonumber(ARGV[first + 2 * r - 1]))
    queue[#queue + 1] = t
    queue[#queue + 1] = id
    waiting[#waiting + 1] = expires
    waiting[#waiting + 1] = id
  end
  if st ~= 0 then token = token + 1 end
  local k = #out
  out[k + 1], out[k + 2], out[k + 3], out[k + 4] = st, t, n[r], expires
end
if n_granted > 0 then
  redis.call('ZADD', K_HOLDERS, unpack(held))
  redis.call('HINCRBY', K_STATS, 'granted', n_granted)
end
if n_parked > 0 then
  redis.call('ZADD', K_QUEUE, unpack(queue))
  redis.call('ZADD', K_WAITERS, unpack(waiting))
  redis.call('HINCRBY', K_STATS, 'parked', n_parked)
end
if n_rejected > 0 then redis.call('HINCRBY', K_STATS, 'rejected', n_rejected) end
return out
