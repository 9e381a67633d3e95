-- Shared library (lib_*.lua, see lib_gate.lua): a gate's configuration and its schema.

-- The gate state's schema (fg:{G}:cfg field 'schema'; see "Schema" in docs/admission.md).
-- Schema 2 (fleetgate 0.2): weighted leases, lanes per (band, tenant). A schema-1 gate is
-- converted by the first script of this version that touches it (upgrade_gate); a newer schema
-- is refused with an error the client turns into ConfigError.
local SCHEMA = 2
-- What schema 2 leaves in fg:{G}:queue: a string, so every script of fleetgate 0.1 (which uses
-- that key as its FIFO) fails with WRONGTYPE before it can grant, instead of miscounting units.
local QUEUE_FENCE = 'fleetgate schema 2: the wait list is in :lanes; a fleetgate older than 0.2 '
  .. 'cannot use this gate, upgrade it'

-- A gate's settings without configuration or caller defaults, and their lower bounds: the same
-- as fleetgate.settings.GateSettings (tests/core/test_settings.py runs this against the struct).
local DEFAULT = {floor = 1, ceiling = 512, max_queued = 1000, lease_ms = 10000, waiter_ms = 5000}
local LOWEST = {floor = 1, ceiling = 1, max_queued = 0, lease_ms = 100, waiter_ms = 100}
local CFG_FIELDS = {'floor', 'ceiling', 'max_queued', 'lease_ms', 'waiter_ms',
  'max_queued_per_tenant', 'shed_below', 'token_limit', 'token_ceiling', 'deadline_admission',
  'band_share', 'revoke_after_ms'}
local N_SETTINGS = #CFG_FIELDS
-- What load_cfg reads in its one HMGET: the schema, the settings, and 'fence' (gate_birth).
-- (Built by a loop: a Functions library's top level runs without unpack.)
local CFG_READ = {'schema'}
for i = 1, N_SETTINGS do CFG_READ[i + 1] = CFG_FIELDS[i] end
CFG_READ[N_SETTINGS + 2] = 'fence'
-- The coordinator's tuned token budget (publish.lua: a second target beside the limit's, written
-- with the same epoch fence and lifetime): its value and the server time it lapses at. Not
-- settings: a client never registers them, and a gate without them is a configured gate too.
CFG_READ[N_SETTINGS + 3] = 'token_target'
CFG_READ[N_SETTINGS + 4] = 'token_target_until'

-- The token budget of cfg (tokens held at once by all leases; docs/admission.md "Token
-- budgets"): cfg.tlim, the budget in force (nil: the gate has none, tokens are counted but never
-- limit a grant), and cfg.token_ceiling, the most tokens one call may ask (never below the
-- budget; nil without a budget). A token ceiling without a budget is no budget. tuned: the
-- coordinator's live token target (nil: none, or lapsed): it replaces the configured budget
-- while it lives, up to the ceiling (as the limit's target stops at the ceiling), and never
-- moves the ceiling (a call the configuration admits is never refused because the budget was
-- tuned down: it waits until the budget has room for it).
local function token_budget(cfg, limit, ceiling, tuned)
  if limit == nil or limit < 1 then return end
  limit = math.floor(limit)
  cfg.token_ceiling = math.max(limit, math.floor(ceiling or limit))
  cfg.tlim = limit
  if tuned and tuned >= 1 then
    cfg.tlim = math.min(math.floor(tuned), cfg.token_ceiling)
    cfg.token_tuned = true
  end
end

-- Band shares (docs/admission.md "Headroom between bands"), as fleetgate.settings encodes them:
-- '<R>=<permille>,...' (R = 100 - priority as 3 digits; permille of the limit that band R and
-- the bands below it may hold, 1..1000) -> a list of {r = R, p = permille} sorted by R, the
-- highest priority first; nil when there is none. A part that does not parse is skipped: a
-- garbled field never fails a call.
local function parse_shares(v)
  if not v or v == '' then return nil end
  local out = {}
  for r, p in string.gmatch(v, '(%d%d%d)=(%d+)') do
    p = tonumber(p)
    if p >= 1 and p <= 1000 and tonumber(r) <= 200 then out[#out + 1] = {r = r, p = p} end
  end
  if #out == 0 then return nil end
  table.sort(out, function(a, b) return a.r < b.r end)
  return out
end

-- Field i (name) of the stored configuration v, else of the caller's defaults d (empty for a
-- configured gate: load_cfg), else DEFAULT; raised to LOWEST.
local function cfg_field(v, d, i, name)
  return math.max(LOWEST[name], math.floor(num(v[i], num(d[i], DEFAULT[name]))))
end

-- Tenant weights as the client and the coordinator send them: 'name}w}name}w' (tenant names
-- never contain a brace).
local function store_tenant_weights(encoded)
  redis.call('DEL', K_TW)
  if encoded == nil or encoded == '' then return end
  local pairs_, name = {}, nil
  for part in string.gmatch(encoded, '[^}]+') do
    if name == nil then
      name = part
    else
      pairs_[#pairs_ + 1] = name
      pairs_[#pairs_ + 1] = part
      name = nil
    end
  end
  if #pairs_ > 0 then redis.call('HSET', K_TW, unpack(pairs_)) end
end

local lane_enter  -- defined below (a converted gate's default lane enters the fair order)

-- Convert a schema-1 gate (fleetgate 0.1: one FIFO zset fg:{G}:queue of ids) to schema 2: each
-- parked id becomes a waiter of the default lane, in the same order, and the queue key becomes
-- the fence. O(waiters), once per gate (the wait list is bounded by max_queued).
local function upgrade_gate()
  local kind = redis.call('TYPE', K_QUEUE)['ok']
  local moved = 0
  if kind == 'zset' then
    local q = redis.call('ZRANGE', K_QUEUE, 0, -1, 'WITHSCORES')
    for j = 1, #q, 2 do
      local id, seq = q[j], tonumber(q[j + 1])
      local expires = redis.call('ZSCORE', K_WAITERS, id)
      if expires then
        local m = '}100}' .. pad20(seq) .. '}' .. id
        redis.call('ZREM', K_WAITERS, id)
        redis.call('ZADD', K_WAITERS, expires, m)
        redis.call('ZADD', K_LANES, 0, m)
        moved = moved + 1
      end
    end
    redis.call('DEL', K_QUEUE)
  end
  -- (a key of another type, planted by hand, is left for `fleetgate check` to report)
  if kind == 'zset' or kind == 'none' then redis.call('SET', K_QUEUE, QUEUE_FENCE) end
  redis.call('HSET', K_CFG, 'schema', SCHEMA)
  -- weight 1 fits any limit: the default lane enters the fair order
  if moved > 0 then lane_enter('}100', 1, 1) end
end

-- Refuse a gate of a newer schema (before anything is written); returns the stored schema
-- (1 when absent: a gate of fleetgate 0.1, or one without configuration).
local function check_schema(stored)
  local s = num(stored, 1)
  if s > SCHEMA then
    error('fleetgate schema: gate ' .. K_CFG .. ' is at schema ' .. string.format('%.0f', s)
      .. ' and this fleetgate knows schema ' .. SCHEMA .. ': upgrade this client or coordinator')
  end
  return s
end

-- The gate's configuration in force at server time now (ms). The stored configuration (fg:{G}:cfg: the coordinator's
-- publish, or what the first client registered) is the one source every script reads: a field
-- it lacks takes DEFAULT, never a caller's value, so the arrival (acquire), the hand-offs of
-- release, cancel and resize, the heartbeat and the snapshot all answer by the same settings.
-- The caller's defaults (d, optional: floor, ceiling, max_queued, lease_ms, waiter_ms,
-- max_queued_per_tenant, shed_below, token_limit, token_ceiling, deadline_admission,
-- band_share, revoke_after_ms, tenant_weights) count only for a gate with no configuration at
-- all: register stores them (acquire), and every script reads them from there on; without register
-- (heartbeat, inspect) they are what an acquire would register. Values below LOWEST are raised
-- to it, and the ceiling to the floor: half-written or garbled configuration never fails a
-- call.
-- Checks the schema first.
-- register: a gate with no configuration at all gets the caller's defaults stored (a client may
-- register defaults only where none exist; the coordinator's publish overwrites them).
local function load_cfg(now, d, register)
  d = d or {}
  local v = redis.call('HMGET', K_CFG, unpack(CFG_READ))
  local schema = check_schema(table.remove(v, 1))
  local fence = v[N_SETTINGS + 1]
  local has = false
  for i = 1, N_SETTINGS do has = has or v[i] end
  -- a configured gate of schema 1 is converted; so is a new one as it is registered (the fence)
  if schema < SCHEMA and (has or register) then upgrade_gate() end
  if has then
    d = {}  -- configured: the stored settings alone apply
  elseif register then
    local pairs_ = {}
    for i, name in ipairs(CFG_FIELDS) do
      if d[i] ~= nil and d[i] ~= '' then
        pairs_[#pairs_ + 1] = name
        pairs_[#pairs_ + 1] = d[i]
      end
    end
    if #pairs_ > 0 then redis.call('HSET', K_CFG, unpack(pairs_)) end
    if d[N_SETTINGS + 1] ~= nil and d[N_SETTINGS + 1] ~= '' then
      store_tenant_weights(d[N_SETTINGS + 1])
    end
  end
  local cfg = {
    floor = cfg_field(v, d, 1, 'floor'),
    max_queued = cfg_field(v, d, 3, 'max_queued'),
    lease_ms = cfg_field(v, d, 4, 'lease_ms'),
    waiter_ms = cfg_field(v, d, 5, 'waiter_ms'),
  }
  cfg.ceiling = math.max(cfg.floor, cfg_field(v, d, 2, 'ceiling'))
  cfg.max_queued_per_tenant = math.max(0, math.floor(num(v[6], num(d[6], cfg.max_queued))))
  cfg.shed_below = math.floor(num(v[7], num(d[7], 0)))
  local tuned = num(v[N_SETTINGS + 2], nil)
  if tuned and num(v[N_SETTINGS + 3], 0) <= now then tuned = nil end  -- lapsed: the configured
  token_budget(cfg, num(v[8], num(d[8], nil)), num(v[9], num(d[9], nil)), tuned)
  -- deadline-aware admission (lib_drain.lua): on unless the configuration says 0; 2: the
  -- deadline covers the band's expected hold too ('finish')
  local da = num(v[10], num(d[10], 1))
  cfg.deadline_admission, cfg.deadline_finish = da ~= 0, da == 2
  -- headroom between bands (lib_share.lua): what the rules of this call read
  cfg.shares = parse_shares(v[11] or d[11])
  SHARES = cfg.shares
  -- revocation (lib_revoke.lua): ms a higher band's head may wait; nil: never
  local ra = num(v[12], num(d[12], nil))
  if ra and ra >= 1 then cfg.revoke_after = ra end
  -- the recovery fence (gate_birth): the server time until which nothing is granted; the field
  -- is absent until a client script has found the gate and marked it (born)
  cfg.born, cfg.fence = fence ~= false, num(fence, 0)
  return cfg
end
