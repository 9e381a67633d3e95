-- acquire: for each request, in order, grant a permit now, park the caller at the tail of the
-- FIFO wait list, or reject. One process sends its callers that asked in the same loop turn as
-- one call (fleetgate.client), so the per-call costs (time, configuration, limit, counts, stats)
-- are paid once per batch and the entries go in with one ZADD per set.
-- KEYS: 1 the gate's base name (see lib.lua)
-- ARGV: 1 floor  2 ceiling  3 max_queued  4 lease_ms  5 waiter_ms  (defaults, registered only
--       when the gate has no configuration yet), then per request: id ('<pod>:<n>'), wait_ms
--       (time the caller is willing to park, > 0)
-- Returns {limit, lease_ms, waiter_ms, then per request: status, token, n, expires_at}:
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

local out = {lim, cfg.lease_ms, cfg.waiter_ms}
local lease_expires = now + cfg.lease_ms
local grants, parks = {}, {}
local waiters_reaped, rejected = false, 0
for i = 6, #ARGV, 2 do
  local id = ARGV[i]
  if queued == 0 and holders < lim then
    holders = holders + 1
    grants[#grants + 1] = id
    out[#out + 1] = 1
    out[#out + 1] = 0  -- token, filled in below
    out[#out + 1] = holders
    out[#out + 1] = lease_expires
  else
    if queued >= cfg.max_queued and not waiters_reaped then
      waiters_reaped = true
      queued = queued - reap_waiters(now)
    end
    if queued >= cfg.max_queued then
      rejected = rejected + 1
      out[#out + 1] = 0
      out[#out + 1] = 0
      out[#out + 1] = cfg.max_queued
      out[#out + 1] = 0
    else
      queued = queued + 1
      parks[#parks + 1] = i
      out[#out + 1] = 2
      out[#out + 1] = 0  -- token, filled in below
      out[#out + 1] = queued
      out[#out + 1] = now + math.min(cfg.waiter_ms, tonumber(ARGV[i + 1]))
    end
  end
end

-- Tokens in request order (a batch is one arrival instant; grants and parks keep their order).
local n_tokens = #grants + #parks
if n_tokens > 0 then
  local token = next_tokens(now, n_tokens)
  local held, queue, waiting = {}, {}, {}
  for r = 1, (#ARGV - 5) / 2 do
    local o = 3 + 4 * (r - 1)
    if out[o + 1] ~= 0 then
      out[o + 2] = token
      local id = ARGV[4 + 2 * r]
      if out[o + 1] == 1 then
        held[#held + 1] = lease_expires
        held[#held + 1] = id
      else
        queue[#queue + 1] = token
        queue[#queue + 1] = id
        waiting[#waiting + 1] = out[o + 4]
        waiting[#waiting + 1] = id
      end
      token = token + 1
    end
  end
  if #held > 0 then
    redis.call('ZADD', K_HOLDERS, unpack(held))
    redis.call('HINCRBY', K_STATS, 'granted', #grants)
  end
  if #queue > 0 then
    redis.call('ZADD', K_QUEUE, unpack(queue))
    redis.call('ZADD', K_WAITERS, unpack(waiting))
    redis.call('HINCRBY', K_STATS, 'parked', #parks)
  end
end
if rejected > 0 then redis.call('HINCRBY', K_STATS, 'rejected', rejected) end
return out
