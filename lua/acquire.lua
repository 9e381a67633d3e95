-- acquire: grant a permit now, park the caller at the tail of the FIFO wait list, or reject.
-- KEYS: the gate keys (see lib.lua)
-- ARGV: 1 id ('<pod>:<n>')  2 wait_ms (time the caller is willing to park, > 0)
--       3 floor  4 ceiling  5 max_queued  6 lease_ms  7 waiter_ms  (defaults, registered only
--       when the gate has no configuration yet)
-- Returns {status, token, limit, n, lease_ms, waiter_ms, expires_at}:
--   status 1 = granted (n = holders), 2 = parked (n = position, 1-based), 0 = rejected because
--   the wait list is full (n = max_queued).
--   token is the fencing token: monotonic per gate in grant order (a parked caller's token is its
--   FIFO sequence number, and nobody barges past it).
--   lease_ms, waiter_ms: the TTLs in force, so the caller paces its first renewal by them.
--   expires_at: server time (ms) at which the granted lease (or the parked entry) expires.
local id, wait_ms = ARGV[1], tonumber(ARGV[2])
local now = now_ms()
ensure_cfg(ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
local cfg = load_cfg()
local lim = settle(now, cfg)

local queued = redis.call('ZCARD', K_QUEUE)
local holders = redis.call('ZCARD', K_HOLDERS)
if queued == 0 and holders < lim then
  local token = next_token(now)
  local expires = now + cfg.lease_ms
  redis.call('ZADD', K_HOLDERS, expires, id)
  redis.call('HINCRBY', K_STATS, 'granted', 1)
  return {1, token, lim, holders + 1, cfg.lease_ms, cfg.waiter_ms, expires}
end
if queued >= cfg.max_queued then
  redis.call('HINCRBY', K_STATS, 'rejected', 1)
  return {0, 0, lim, cfg.max_queued, cfg.lease_ms, cfg.waiter_ms, 0}
end
local token = next_token(now)
local expires = now + math.min(cfg.waiter_ms, wait_ms)
redis.call('ZADD', K_QUEUE, token, id)
redis.call('ZADD', K_WAITERS, expires, id)
redis.call('HINCRBY', K_STATS, 'parked', 1)
return {2, token, lim, queued + 1, cfg.lease_ms, cfg.waiter_ms, expires}
