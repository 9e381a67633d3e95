-- inspect: a consistent, read-only snapshot of one gate for the CLI and utilization().
-- KEYS: 1 the gate's base name (see lib_gate.lua)
-- ARGV: 1 how many head waiters and holders to list: 0 or less lists none (the counts are still
--         exact), at most INSPECT_MAX, so one snapshot costs O(log n + listed), never O(queue)
--       2.. optional defaults (GateSettings.argv(): floor, ceiling, max_queued, lease_ms,
--       waiter_ms, max_queued_per_tenant, shed_below, token_limit, token_ceiling,
--       deadline_admission, band_share, revoke_after_ms) for a gate that has no configuration
--       yet: the
--       snapshot shows what an acquire would register
-- Returns a JSON object: now, schema, cfg, target, limit, floor, ceiling, max_queued,
--   max_queued_per_tenant, shed_below, tenant_weights, lease_ms, waiter_ms (the configuration
--   in force), token_limit and token_ceiling (the token budget in force, absent: none;
--   token_tuned: the budget is the coordinator's live token target, not the configured one),
--   deadline_admission (on or off), deadline_finish, revoke_after_ms (0: never), band_share
--   (priority -> permille of the limit that band
--   and the ones below it may hold) and band_units (priority -> units its leases hold), obs
--   (the client-observed counters, token usage included), holders
--   (unexpired leases), units (units held, expired-but-unreaped included: what the next grant
--   counts), tokens (tokens held, counted so), queued, live_pods, stats, util,
--   lanes (first lanes in service order, then oversize ones: priority, tenant, queued, tag or
--   oversize, reserved), head (their first waiters: id, token (seq), weight, priority, tenant,
--   tokens, expires_at), leases (first holders: id, weight, tokens, expires_at).
-- Expired entries that nobody reaped yet are not counted (the snapshot applies the same rule
-- as the next write would).
-- A snapshot never lists the whole queue: 100,000 waiters listed would block Redis for ~0.3 s.
local INSPECT_MAX = 1000
local n = math.floor(num(ARGV[1], 0))
if n > INSPECT_MAX then n = INSPECT_MAX end
local now = now_ms()
local cfg = load_cfg(now, {ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], nil, nil, ARGV[9],
  ARGV[10], ARGV[11], ARGV[12], ARGV[13]})

local function pairs_to_map(flat)
  local m = {}
  for j = 1, #flat, 2 do m[flat[j]] = flat[j + 1] end
  return m
end

-- The band shares as priority -> permille, and the units each band holds (priority -> units);
-- extra: adm 'extra'.
local function band_views(extra)
  local band_share, by_band = {}, {}
  local n_held = redis.call('ZCARD', K_HOLDERS)
  for b, u in pairs(n_held > 0 and adm_bands('held', n_held + extra) or {}) do
    if u > 0 then by_band[tostring(100 - tonumber(b))] = u end
  end
  for _, e in ipairs(cfg.shares or {}) do band_share[tostring(100 - tonumber(e.r))] = e.p end
  return band_share, by_band
end

local head, leases, lanes = {}, {}, {}
local function lane_info(lane, tag)
  local lo, hi = lane_range(lane)
  local r = lane_band(lane)
  local t = lane_tenant(lane)
  local info = {priority = 100 - tonumber(r), tenant = t,
    queued = redis.call('ZLEXCOUNT', K_LANES, lo, hi)}
  if tag then info.tag = string.format('%.0f', tag) else info.oversize = true end
  local rsv = adm_get('rsv:' .. r)
  if rsv and member_lane(rsv) == lane then info.reserved = member_id(rsv) end
  return info
end
-- n <= 0 must list nothing: ZRANGE 0 n-1 would be ZRANGE 0 -1 (everything) for n = 0.
if n > 0 then
  -- the lanes in the order they are served (then the oversize ones), and each lane's head
  for _, fm in ipairs(redis.call('ZRANGEBYLEX', K_FAIR, '-', '+', 'LIMIT', 0, n)) do
    local lane, tag = fair_parse(fm)
    lanes[#lanes + 1] = lane_info(lane, tag)
  end
  for _, lane in ipairs(redis.call('ZRANGE', K_BIG, 0, n - 1)) do
    lanes[#lanes + 1] = lane_info(lane, nil)
  end
  for _, l in ipairs(lanes) do
    if #head >= n then break end
    local lane = l.tenant .. '}' .. string.format('%03d', 100 - l.priority)
    local lo, hi = lane_range(lane)
    for _, m in ipairs(redis.call('ZRANGEBYLEX', K_LANES, lo, hi, 'LIMIT', 0, n - #head)) do
      local id = member_id(m)
      head[#head + 1] = {id = id, token = string.match(m, '}0*(%d+)}[^}]*$'),
        weight = weight_of(id), tokens = tokens_asked(id), priority = l.priority,
        tenant = l.tenant,
        expires_at = tonumber(redis.call('ZSCORE', K_WAITERS, m))}
    end
  end
  local h = redis.call('ZRANGEBYSCORE', K_HOLDERS, '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, n)
  for j = 1, #h, 2 do
    leases[#leases + 1] = {id = h[j], weight = weight_of(h[j]), tokens = tokens_asked(h[j]),
      expires_at = tonumber(h[j + 1])}
  end
end

local extra = num(redis.call('HGET', K_ADM, 'extra'), 0)
local band_share, by_band = band_views(extra)
local out = cjson.encode({
  now = now,
  schema = SCHEMA,
  cfg = pairs_to_map(redis.call('HGETALL', K_CFG)),
  target = pairs_to_map(redis.call('HGETALL', K_TARGET)),
  limit = current_limit(now, cfg),
  floor = cfg.floor,
  ceiling = cfg.ceiling,
  token_limit = cfg.tlim,
  token_ceiling = cfg.token_ceiling,
  token_tuned = cfg.token_tuned or false,
  deadline_admission = cfg.deadline_admission,
  deadline_finish = cfg.deadline_finish,
  revoke_after_ms = cfg.revoke_after or 0,
  band_share = band_share,
  band_units = by_band,
  tokens = redis.call('ZCARD', K_HOLDERS) > 0 and num(redis.call('HGET', K_ADM, 'tok'), 0) or 0,
  max_queued = cfg.max_queued,
  max_queued_per_tenant = cfg.max_queued_per_tenant,
  shed_below = cfg.shed_below,
  tenant_weights = pairs_to_map(redis.call('HGETALL', K_TW)),
  lease_ms = cfg.lease_ms,
  waiter_ms = cfg.waiter_ms,
  holders = redis.call('ZCOUNT', K_HOLDERS, '(' .. now, '+inf'),
  units = redis.call('ZCARD', K_HOLDERS) + extra,
  queued = redis.call('ZCOUNT', K_WAITERS, '(' .. now, '+inf'),
  live_pods = redis.call('ZCOUNT', K_PODS, '(' .. now, '+inf'),
  stats = pairs_to_map(redis.call('HGETALL', K_STATS)),
  util = pairs_to_map(redis.call('HGETALL', K_UTIL)),
  obs = pairs_to_map(redis.call('HGETALL', K_OBS)),
  head = head,
  leases = leases,
  lanes = lanes,
})
adm_flush()
return out
