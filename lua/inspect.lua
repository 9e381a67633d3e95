-- inspect: a consistent, read-only snapshot of one gate for the CLI and utilization().
-- KEYS: 1 the gate's base name (see lib.lua)
-- ARGV: 1 how many head waiters and holders to list: 0 or less lists none (the counts are still
--         exact), at most INSPECT_MAX, so one snapshot costs O(log n + listed), never O(queue)
--       2..6 optional defaults (floor, ceiling, max_queued, lease_ms, waiter_ms) for a gate that
--       has no configuration yet: the snapshot shows what an acquire would register
-- Returns a JSON object: now, cfg, target, limit, floor, ceiling, max_queued, lease_ms, waiter_ms
--   (the configuration in force), holders, queued, live_pods, stats, util,
--   head (first waiters: id, token, expires_at), leases (first holders: id, expires_at).
-- Expired entries that nobody reaped yet are not counted (the snapshot applies the same rule
-- as the next write would).
-- A snapshot never lists the whole queue: 100,000 waiters listed would block Redis for ~0.3 s.
local INSPECT_MAX = 1000
local n = math.floor(num(ARGV[1], 0))
if n > INSPECT_MAX then n = INSPECT_MAX end
local now = now_ms()
local cfg = load_cfg({ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]})

local function pairs_to_map(flat)
  local m = {}
  for j = 1, #flat, 2 do m[flat[j]] = flat[j + 1] end
  return m
end

local head, leases = {}, {}
-- n <= 0 must list nothing: ZRANGE 0 n-1 would be ZRANGE 0 -1 (everything) for n = 0.
if n > 0 then
  local q = redis.call('ZRANGE', K_QUEUE, 0, n - 1, 'WITHSCORES')
  for j = 1, #q, 2 do
    -- tokens are beyond cjson's 14 significant digits (seeded from server time): a string
    head[#head + 1] = {id = q[j], token = string.format('%.0f', tonumber(q[j + 1])),
      expires_at = tonumber(redis.call('ZSCORE', K_WAITERS, q[j]))}
  end
  local h = redis.call('ZRANGEBYSCORE', K_HOLDERS, '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, n)
  for j = 1, #h, 2 do leases[#leases + 1] = {id = h[j], expires_at = tonumber(h[j + 1])} end
end

return cjson.encode({
  now = now,
  cfg = pairs_to_map(redis.call('HGETALL', K_CFG)),
  target = pairs_to_map(redis.call('HGETALL', K_TARGET)),
  limit = current_limit(now, cfg),
  floor = cfg.floor,
  ceiling = cfg.ceiling,
  max_queued = cfg.max_queued,
  lease_ms = cfg.lease_ms,
  waiter_ms = cfg.waiter_ms,
  holders = redis.call('ZCOUNT', K_HOLDERS, '(' .. now, '+inf'),
  queued = redis.call('ZCOUNT', K_WAITERS, '(' .. now, '+inf'),
  live_pods = redis.call('ZCOUNT', K_PODS, '(' .. now, '+inf'),
  stats = pairs_to_map(redis.call('HGETALL', K_STATS)),
  util = pairs_to_map(redis.call('HGETALL', K_UTIL)),
  head = head,
  leases = leases,
})
