-- fleetgate shared library: the top of the gate scripts' Redis Functions library
-- (fleetgate.scripts.gate_library; prepended to a script for EVAL by script_source), so the rules
-- for time, limit, reaping and hand-off are written once. A library's top level runs once, at
-- load, so nothing here may keep state across calls except through use_gate, which every call
-- runs first.
--
-- KEYS[1] is the gate's base name, '<prefix>:{<gate>}' (fleetgate.keys.GateKeys.base); every key
-- of the gate is that base plus a fixed suffix (the same names as GateKeys, checked by
-- tests/test_scripts.py::test_scripts_write_only_the_keys_gate_keys_names). One name costs the
-- client less to encode than ten (the "+ gate KEYS/ARGV" row of benchmarks/uncontended.py);
-- every derived key shares the base's hash tag, so it lives in the slot the call is routed to.
-- On Cluster the client declares the data keys too (fleetgate._redis.RedisMode.script_keys).
-- The wake list of a pod is K_WAKE .. pod_id.
local K_CFG, K_TARGET, K_HOLDERS, K_QUEUE, K_WAITERS, K_SEQ, K_STATS, K_PODS, K_UTIL, K_WAKE
local K_LANES, K_FAIR, K_BIG, K_ADM, K_TW, K_EVICTED, K_OBS
local ADM, ADM_DIRTY, PHI  -- per-gate caches of one call (see "Admission order" below)
local function use_gate(base)
  K_CFG, K_TARGET, K_HOLDERS = base .. ':cfg', base .. ':target', base .. ':holders'
  K_QUEUE, K_WAITERS, K_SEQ = base .. ':queue', base .. ':waiters', base .. ':seq'
  K_STATS, K_PODS, K_UTIL = base .. ':stats', base .. ':pods', base .. ':util'
  K_WAKE = base .. ':wake:'
  K_LANES, K_FAIR, K_BIG = base .. ':lanes', base .. ':fair', base .. ':big'
  K_ADM, K_TW, K_EVICTED = base .. ':adm', base .. ':tw', base .. ':evicted'
  K_OBS = base .. ':obs'
  ADM, ADM_DIRTY, PHI = {}, {}, {}
end
-- EVAL form only: gate_library drops the next line (each library function runs it first).
use_gate(KEYS[1])

-- Expired entries removed per call, per kind. A bound keeps every call O(log n) even after a
-- mass crash; the coordinator's reaper and every later call sweep the rest.
local REAP_MAX = 64
-- Grants handed to head waiters per call; a larger limit jump is finished by the next calls.
local HANDOFF_MAX = 256
-- Dead heads (expired waiter entries) a hand-off drops per call: the release that hands off does
-- not reap first, so this is the reap bound and the drop bound that used to follow it, together.
local DROP_MAX = 2 * REAP_MAX

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A number, or the default for nil, NaN, infinities (tonumber accepts 'inf' and '1e400') and
-- magnitudes beyond 2^53, where a lease would never expire or a floor would lift the cap.
local NUM_MAX = 9007199254740992
local function num(v, default)
  local n = tonumber(v)
  if n == nil or n ~= n or n > NUM_MAX or n < -NUM_MAX then return default end
  return n
end


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
-- as fleetgate.settings.GateSettings (tests/test_settings.py runs this against the struct).
local DEFAULT = {floor = 1, ceiling = 512, max_queued = 1000, lease_ms = 10000, waiter_ms = 5000}
local LOWEST = {floor = 1, ceiling = 1, max_queued = 0, lease_ms = 100, waiter_ms = 100}
local CFG_FIELDS = {'floor', 'ceiling', 'max_queued', 'lease_ms', 'waiter_ms',
  'max_queued_per_tenant', 'shed_below'}
local N_SETTINGS = #CFG_FIELDS
-- What load_cfg reads in its one HMGET: the schema, the settings, and 'fence' (gate_birth).
-- (Built by a loop: a Functions library's top level runs without unpack.)
local CFG_READ = {'schema'}
for i = 1, N_SETTINGS do CFG_READ[i + 1] = CFG_FIELDS[i] end
CFG_READ[N_SETTINGS + 2] = 'fence'

-- Field i (name) of the stored configuration v, else of the caller's defaults d, else DEFAULT;
-- raised to LOWEST.
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

local function pad20(n)
  return string.format('%020.0f', n)
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

-- The gate's configuration in force. Missing fields take the caller's defaults (d, optional:
-- floor, ceiling, max_queued, lease_ms, waiter_ms, max_queued_per_tenant, shed_below,
-- tenant_weights), then DEFAULT; values below LOWEST are raised to it, and the ceiling to the
-- floor: half-written or garbled configuration never fails a call. Checks the schema first.
-- register: a gate with no configuration at all gets the caller's defaults stored (a client may
-- register defaults only where none exist; the coordinator's publish overwrites them).
local function load_cfg(d, register)
  d = d or {}
  local v = redis.call('HMGET', K_CFG, unpack(CFG_READ))
  local schema = check_schema(table.remove(v, 1))
  local fence = v[N_SETTINGS + 1]
  local has = false
  for i = 1, N_SETTINGS do has = has or v[i] end
  -- a configured gate of schema 1 is converted; so is a new one as it is registered (the fence)
  if schema < SCHEMA and (has or register) then upgrade_gate() end
  if register and not has then
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
  -- the recovery fence (gate_birth): the server time until which nothing is granted; the field
  -- is absent until a client script has found the gate and marked it (born)
  cfg.born, cfg.fence = fence ~= false, num(fence, 0)
  return cfg
end

-- The recovery fence. A gate found without state (a Redis restarted empty, FLUSHALL, a new gate:
-- inside Redis the three look the same) may still have work running in pods that counted it in
-- the lost state: pods in the fair-share fallback adopt theirs when their probe succeeds, pods
-- that saw nothing count theirs again with their next heartbeat. Until they have, no grant is
-- made: the first client script that finds the state missing (acquire, heartbeat, adopt) marks
-- the gate born (cfg 'fence' present) and fences it for fence_ms, one registration period of
-- the calling pod (every pod with work beats its gates well within it): cfg 'fence' = the end.
-- Waiters park meanwhile and are handed off when it ends. The node key '<prefix>:born'
-- remembers when this server first held fleetgate state under the prefix: a gate born a fence
-- period after that is new, not wiped, and is not fenced ('fence' = the time it was born), so
-- only the first moments of an empty server (or a wiped one) pay, and a gate with state never
-- does: its 'fence' comes with the HMGET above, and the node key is read only here. On Cluster
-- a script reaches only its gate's slot, so the node key is out of reach (pcall) and every gate
-- found without state is fenced. fence_ms 0 (the coordinator's sweep, a fleet without a fence)
-- marks nothing. State left by a fleetgate without birth marks (holders or waiters present) is
-- marked born without a fence.
local function gate_birth(now, cfg, fence_ms)
  if cfg.born or fence_ms <= 0 then return end
  local until_ = now
  -- (live pods alone are no state: an idle pod without a fence registers itself on a wiped
  -- gate too, and the node key is left alone here: a gate's leftovers say nothing of the
  -- server's other gates)
  if redis.call('EXISTS', K_HOLDERS, K_WAITERS) == 0 then
    until_ = now + fence_ms
    local node_key = string.match(K_CFG, '^([^:]*):{') .. ':born'
    local first = redis.pcall('GET', node_key)
    if type(first) ~= 'table' then  -- a reply, not an error (Cluster: another slot)
      first = num(first, nil)
      if first == nil then
        first = now
        redis.pcall('SET', node_key, string.format('%.0f', now))
      end
      until_ = math.min(until_, first + fence_ms)
    end
  end
  cfg.born, cfg.fence = true, until_
  redis.call('HSET', K_CFG, 'fence', string.format('%.0f', math.max(until_, now)))
end

-- limit = the unexpired target, else floor; clamped to [floor, ceiling].
local function current_limit(now, cfg)
  local t = redis.call('HMGET', K_TARGET, 'value', 'expires_at')
  local lim = cfg.floor
  local value, expires_at = num(t[1], nil), num(t[2], nil)
  if value and expires_at and expires_at > now then lim = math.floor(value) end
  if lim < cfg.floor then lim = cfg.floor end
  if lim > cfg.ceiling then lim = cfg.ceiling end
  return lim
end

---------------------------------------------------------------------------------------------
-- Admission order: weights, bands, tenants (docs/admission.md says why it is built so).
--
-- Weights live in lease ids: '<pod>:<n>' weighs 1, '<pod>:<n>w<W>' weighs W. Units held =
-- ZCARD holders + adm.extra, extra = sum of (W - 1) over the holders: weight-1 leases never
-- touch the counter. Every path that adds a lease raises extra before the ZADD and every path
-- that removes one lowers it after the ZREM, so a script stopped half-way can only overcount.
--
-- A waiter is a member of fg:{G}:lanes (all scores 0, ordered by bytes):
--   '<tenant>}<R>}<seq20>}<id>'   R = 100 - priority as 3 digits (000 = priority 100 first)
-- and the same member is its entry in fg:{G}:waiters (score = expiry). A lane is (tenant, R),
-- named '<tenant>}<R>'; FIFO inside it by seq. Tenant and gate names never hold a brace.
-- Every non-empty lane is in exactly one of:
--   fg:{G}:fair  (scores 0) '<R>}<F20>}<tenant>': eligible lanes, so the first member is the
--                next lane to serve: the highest band, then the smallest virtual finish tag F
--                of its head (self-clocked fair queuing on units per band);
--   fg:{G}:big   lane -> head weight: the head weighs more than the limit (waits for it to grow).
-- fg:{G}:adm holds: extra, 'vt:<R>' (the band's virtual time: the largest tag granted),
-- 'f:<lane>' (the lane's tag in fair, present iff the lane is in fair), 'rsv:<R>' (the waiter
-- the band's free units are reserved for). fg:{G}:tw: tenant -> weight (1..1000).
---------------------------------------------------------------------------------------------

local DEFAULT_LANE = '}100'

local function adm_get(field)
  local v = ADM[field]
  if v == nil then
    v = redis.call('HGET', K_ADM, field) or false
    ADM[field] = v
  end
  if v == false then return nil end
  return v
end

local function adm_set(field, value)
  ADM[field] = value or false
  ADM_DIRTY[field] = true
end

-- Read the adm fields not cached yet in one HMGET.
local function adm_prefetch(...)
  local fields = {}
  for _, field in ipairs({...}) do
    if ADM[field] == nil then fields[#fields + 1] = field end
  end
  if #fields == 0 then return end
  local v = redis.call('HMGET', K_ADM, unpack(fields))
  for i, field in ipairs(fields) do ADM[field] = v[i] end
end

-- Write the cached adm fields that changed; every script that changed some calls it before it
-- returns (and heartbeat_many before it moves to the next gate).
local function adm_flush()
  local set, del = {}, {}
  for field in pairs(ADM_DIRTY) do
    local v = ADM[field]
    if v then
      set[#set + 1] = field
      set[#set + 1] = v
    else
      del[#del + 1] = field
    end
  end
  if #set > 0 then redis.call('HSET', K_ADM, unpack(set)) end
  if #del > 0 then redis.call('HDEL', K_ADM, unpack(del)) end
  ADM_DIRTY = {}
end

local function weight_of(id)
  local w = string.match(id, ':%d+w(%d+)$')
  if w then return tonumber(w) end
  return 1
end

local function member_id(m)
  return string.match(m, '}([^}]*)$') or m
end

local function member_lane(m)
  return string.match(m, '^([^}]*}%d%d%d)}')
end

local function lane_band(lane)
  return string.sub(lane, -3)
end

local function lane_tenant(lane)
  return string.sub(lane, 1, -5)
end

-- The lane of a request's class: '' = priority 0 of the default tenant, else '<R>}<tenant>'.
local function class_lane(cls)
  if cls == nil or cls == '' then return DEFAULT_LANE end
  return string.sub(cls, 5) .. '}' .. string.sub(cls, 1, 3)
end

local function lane_range(lane)
  return '[' .. lane .. '}', '(' .. lane .. '~'
end

local function fair_member(lane, f)
  return lane_band(lane) .. '}' .. pad20(f) .. '}' .. lane_tenant(lane)
end

-- lane, tag, band of a fair member
local function fair_parse(fm)
  local r, f, t = string.match(fm, '^(%d%d%d)}(%d+)}(.*)$')
  return t .. '}' .. r, tonumber(f), r
end

-- A tenant's weight (1..1000; 1 when not configured); the default tenant weighs 1.
local function tenant_weight(t)
  if t == '' then return 1 end
  local v = PHI[t]
  if v == nil then
    v = math.floor(num(redis.call('HGET', K_TW, t), 1))
    if v < 1 then v = 1 elseif v > 1000 then v = 1000 end
    PHI[t] = v
  end
  return v
end

-- The virtual service a grant of w units costs a lane of tenant t.
local function cost(w, t)
  return math.ceil(w * 1000 / tenant_weight(t))
end

-- Units held: holders plus the extra weight of the heavy ones (extra: HGET adm extra if the
-- caller read it already, false when absent). A counter left by a script that stopped half-way
-- (only ever an overcount) is dropped once no lease is left.
local function units_held(extra)
  local n = redis.call('ZCARD', K_HOLDERS)
  if extra == nil then extra = redis.call('HGET', K_ADM, 'extra') end
  extra = num(extra, 0)
  if extra ~= 0 and n == 0 then
    redis.call('HDEL', K_ADM, 'extra')
    extra = 0
  end
  return n + extra
end

-- Add granted leases: members = {expires, id, ...}, extra = sum of (weight - 1) of their ids.
local function add_leases(members, extra)
  if extra > 0 then redis.call('HINCRBY', K_ADM, 'extra', extra) end
  redis.call('ZADD', K_HOLDERS, unpack(members))
end

-- Remove the lease ids ids[i..j]; returns (leases removed, units freed). An id already gone
-- frees nothing.
local function remove_leases(ids, i, j)
  local heavy = false
  for k = i, j do
    if string.find(ids[k], 'w', 1, true) and weight_of(ids[k]) > 1 then
      heavy = true
      break
    end
  end
  if not heavy then
    local n = redis.call('ZREM', K_HOLDERS, unpack(ids, i, j))
    return n, n
  end
  local n, units = 0, 0
  for k = i, j do
    if redis.call('ZREM', K_HOLDERS, ids[k]) == 1 then
      n = n + 1
      units = units + weight_of(ids[k])
    end
  end
  if units > n and redis.call('HINCRBY', K_ADM, 'extra', n - units) == 0 then
    redis.call('HDEL', K_ADM, 'extra')  -- no field is left once every heavy lease is gone
  end
  return n, units
end

-- The client-observed signal (fleetgate/observed.py): args[i..j] are (field, increment) pairs
-- the client summed over the reports of the calls it releases in this script call (outcome
-- counts, latency count and sum, latency buckets). Best effort: pcall, so a broken obs key
-- (wrong type, a value that is no integer) never fails the release it travels with.
local function observe(args, i, j)
  for k = i, j - 1, 2 do
    redis.pcall('HINCRBY', K_OBS, args[k], args[k + 1])
  end
end

-- The start of a lane whose head (weight w, tenant t) has tag f: f minus the head's cost, never
-- below 0 -- the cost is taken at the tenant's weight now, and a publish may have changed it
-- since the tag was made (the tag would go negative and no longer parse: found by the model).
local function start_of(f, w, t)
  return math.max(0, f - cost(w, t))
end

-- A lane that became backlogged (or left big): it enters the fair order at its band's virtual
-- time (no credit for idle time), or big if its head weighs more than the limit.
lane_enter = function(lane, w_head, lim)
  if w_head > lim then
    redis.call('ZADD', K_BIG, w_head, lane)
    return
  end
  local f = num(adm_get('vt:' .. lane_band(lane)), 0) + cost(w_head, lane_tenant(lane))
  redis.call('ZADD', K_FAIR, 0, fair_member(lane, f))
  adm_set('f:' .. lane, pad20(f))
end

-- A lane left the fair order: when it was the band's last, the band's virtual time goes too
-- (an idle band starts again from 0: no credit is kept for anyone).
local function left_fair(lane, f)
  redis.call('ZREM', K_FAIR, fair_member(lane, f))
  adm_set('f:' .. lane, nil)
  local r = lane_band(lane)
  if #redis.call('ZRANGEBYLEX', K_FAIR, '[' .. r .. '}', '(' .. r .. '~', 'LIMIT', 0, 1) == 0 then
    adm_set('vt:' .. r, nil)
  end
end

-- After waiters of the lanes in `touched` (lane -> true) left them: an emptied lane leaves the
-- fair order (or big); a lane in big is re-scored by its new head.
local function lanes_touched(touched)
  for lane in pairs(touched) do
    local lo, hi = lane_range(lane)
    local left = redis.call('ZRANGEBYLEX', K_LANES, lo, hi, 'LIMIT', 0, 1)
    local f = adm_get('f:' .. lane)
    if #left == 0 then
      if f then
        left_fair(lane, tonumber(f))
      else
        redis.call('ZREM', K_BIG, lane)
      end
    elseif not f then
      redis.call('ZADD', K_BIG, weight_of(member_id(left[1])), lane)
    end
  end
end

-- Remove waiter members (from lanes and waiters) and repair their lanes.
local function remove_waiters(members)
  if #members == 0 then return end
  redis.call('ZREM', K_WAITERS, unpack(members))
  redis.call('ZREM', K_LANES, unpack(members))
  local touched = {}
  for _, m in ipairs(members) do
    local lane = member_lane(m)
    if lane then
      touched[lane] = true
      local key = 'rsv:' .. lane_band(lane)
      if adm_get(key) == m then adm_set(key, nil) end  -- its reservation goes with it
    end
  end
  lanes_touched(touched)
end

-- Lanes of big whose head now fits under the limit enter the fair order (bounded per call).
local function readmit(lim)
  local lanes = redis.call('ZRANGEBYSCORE', K_BIG, '-inf', lim, 'LIMIT', 0, 16)
  for _, lane in ipairs(lanes) do
    local lo, hi = lane_range(lane)
    local head = redis.call('ZRANGEBYLEX', K_LANES, lo, hi, 'LIMIT', 0, 1)
    redis.call('ZREM', K_BIG, lane)
    if #head > 0 then lane_enter(lane, weight_of(member_id(head[1])), lim) end
  end
end

-- Remove up to REAP_MAX expired leases; returns the units freed. Called where they matter: by
-- an acquire that finds the gate full, and by every heartbeat and sweep (so an expired lease of
-- a gate below its limit, which blocks nobody, goes within a heartbeat period).
local function reap_leases(now)
  local leases = redis.call('ZRANGEBYSCORE', K_HOLDERS, '-inf', now, 'LIMIT', 0, REAP_MAX)
  if #leases == 0 then return 0 end
  local n, units = remove_leases(leases, 1, #leases)
  redis.call('HINCRBY', K_STATS, 'expired_leases', n)
  return units
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
-- later write of the script through (tests/test_fault_holes.py, the "oom" case).
local function reap_evicted(now)
  local gone = redis.call('ZRANGEBYSCORE', K_EVICTED, '-inf', now, 'LIMIT', 0, REAP_MAX)
  if #gone > 0 then redis.call('ZREM', K_EVICTED, unpack(gone)) end
end

local function reap(now)
  reap_leases(now)
  reap_waiters(now)
  reap_evicted(now)
end

local refuse_heads  -- defined below, after handoff (which calls it)

-- Wake-ups of one call, grouped by pod: one RPUSH (and PEXPIRE) per pod, not per id. Ids are
-- '<pod-id>:<n>[w<W>]'; the pod id is everything before the last colon. A wake is
-- '<id>=<token>' (granted, with its fencing token), '<id>=x' (evicted: Overloaded) or
-- '<id>=c<C>' (refused: heavier than the ceiling C now in force; ConfigError, see refuse_heads).
local function new_wakes()
  return {pods = {}, values = {}}
end

local function add_wake(wakes, id, value)
  local pod = string.match(id, '^(.*):[^:]*$')
  if pod then
    local values = wakes.values[pod]
    if values == nil then
      values = {}
      wakes.values[pod] = values
      wakes.pods[#wakes.pods + 1] = pod
    end
    values[#values + 1] = value
  end
end

local function send_wakes(wakes, cfg)
  for _, pod in ipairs(wakes.pods) do
    local key = K_WAKE .. pod
    redis.call('RPUSH', key, unpack(wakes.values[pod]))
    -- A dead pod's list disappears by itself; a live pod pops it long before this.
    redis.call('PEXPIRE', key, cfg.waiter_ms * 2)
  end
end

-- The first of k new fencing tokens, k >= 1: the call's tokens are first .. first + k - 1.
-- Never below server time x 1000: a token issued at server time t lies in [t x 1000, the
-- counter], and the counter runs ahead of the clock only while the gate grants more than 1000
-- per millisecond. So tokens stay above every token the gate ever issued when the counter is
-- lost (a restart: it starts again at the clock) or rolled back (a failover to a replica that
-- missed the last grants: the clock is past them), unless the new server's clock is behind the
-- old one's by more than the time between (tests/test_tokens.py). Holders also raise it
-- above their own tokens (raise_seq). A parked caller's seq (its place in its lane) comes from
-- the same counter, so later arrivals never sort before it; its fencing token is a fresh one
-- taken when it is granted.
local SEQ_PER_MS = 1000
local function next_tokens(now, k)
  local t = redis.call('INCRBY', K_SEQ, k)
  local least = now * SEQ_PER_MS + k - 1
  if t < least then
    t = least
    redis.call('SET', K_SEQ, string.format('%.0f', t))
  end
  return t - k + 1
end

local function raise_seq(token)
  if token and token > 0 then
    local s = num(redis.call('GET', K_SEQ), 0)
    if s < token then redis.call('SET', K_SEQ, string.format('%.0f', token)) end
  end
end

-- Hand free units to waiters and wake their pods: the top band first (strict), within it the
-- lane with the smallest tag (fair queuing across tenants), FIFO within a lane; a head that does
-- not fit stops everything and keeps the free units (reserved for it: no passing); a head
-- heavier than the limit moves its lane to big. A dead head (its waiter entry expired) is
-- dropped. Bounded per call: HANDOFF_MAX grants, DROP_MAX drops. units: the units held if the
-- caller knows them. Returns (grants, waiters removed, units granted).
local function handoff(now, cfg, lim, units)
  local free = lim - (units or units_held())
  if free <= 0 or cfg.fence > now then  -- full, or behind the recovery fence (gate_birth)
    adm_flush()
    return 0, 0, 0
  end
  local grants, gone, extra, dropped, granted_units = {}, {}, 0, 0, 0
  local gone_in = {}  -- lane -> members of it already removed in this call (its head prefix)
  local stop, turns = false, 0
  while not stop and #grants < HANDOFF_MAX and dropped < DROP_MAX and turns < 2 * HANDOFF_MAX do
    turns = turns + 1
    local top = redis.call('ZRANGEBYLEX', K_FAIR, '-', '+', 'LIMIT', 0, 2)
    if #top == 0 then break end
    local lane, f, r = fair_parse(top[1])
    local bound = nil  -- the tag of the best other lane of the band
    if #top > 1 then
      local _, f2, r2 = fair_parse(top[2])
      if r2 == r then bound = f2 end
    end
    adm_prefetch('rsv:' .. r, 'vt:' .. r)
    local rsv = adm_get('rsv:' .. r)
    if rsv then
      local rlane = member_lane(rsv)
      local rf = rlane and num(adm_get('f:' .. rlane), nil)
      if rf == nil then
        adm_set('rsv:' .. r, nil)
        rsv = nil
      elseif rlane ~= lane then
        lane, f, bound = rlane, rf, f
      end
    end
    local old_f, t = f, lane_tenant(lane)
    local want = math.min(free, HANDOFF_MAX - #grants)
    -- with other lanes in the band this lane serves a few before the tags are compared again
    if bound and want > 8 then want = 8 end
    local lo, hi = lane_range(lane)
    local heads = redis.call('ZRANGEBYLEX', K_LANES, lo, hi, 'LIMIT', gone_in[lane] or 0, want + 1)
    if rsv and member_lane(rsv) == lane and heads[1] ~= rsv then
      -- the reserved waiter left its lane: serve by tags again (the next turn looks again)
      adm_set('rsv:' .. r, nil)
    else
      local alive = {}
      if #heads > 0 then alive = redis.call('ZMSCORE', K_WAITERS, unpack(heads)) end
      local vt0 = num(adm_get('vt:' .. r), 0)
      local vt = vt0
      -- Alone in its band (no other eligible lane), a lane is served without moving the band's
      -- virtual time or its own start: relative to each other, a lane that joins later (at
      -- vt + its cost) and this one (at vt + its head's cost) are where they would be had both
      -- moved, and a gate used with defaults writes neither tags nor times per grant.
      local alone = bound == nil
      local last = math.min(#heads, want)
      local state = 'open'  -- what the lane is after this turn: open, big (head i), empty
      local i = 1
      while i <= last do
        local m = heads[i]
        local id = member_id(m)
        local w = weight_of(id)
        local expires = tonumber(alive[i])
        -- a head heavier than the ceiling (lowered after it parked) can never be granted: it is
        -- dropped as a dead one is, and refused below (refuse_heads)
        if expires == nil or expires <= now or w > cfg.ceiling then
          gone[#gone + 1] = m
          dropped = dropped + 1
          if rsv == m then
            adm_set('rsv:' .. r, nil)
            rsv = nil
          end
          -- the next head takes the dropped one's turn
          if i < #heads then f = start_of(f, w, t) + cost(weight_of(member_id(heads[i + 1])), t) end
          i = i + 1
          if dropped >= DROP_MAX then break end
        elseif w > lim then
          state = 'big'
          break
        elseif bound and f > bound and rsv ~= m then
          break  -- another lane of the band has the smaller tag now (before any reservation:
                 -- only the chosen head, the band's smallest tag, reserves)
        elseif w > free then
          adm_set('rsv:' .. r, m)  -- the free units wait for it: nobody passes it
          stop = true
          break
        else
          gone[#gone + 1] = m
          grants[#grants + 1] = id
          extra = extra + w - 1
          free = free - w
          granted_units = granted_units + w
          if rsv == m then
            adm_set('rsv:' .. r, nil)
            rsv = nil
          end
          if alone then
            if i < #heads then f = start_of(f, w, t) + cost(weight_of(member_id(heads[i + 1])), t) end
          else
            if f > vt then vt = f end
            if i < #heads then f = vt + cost(weight_of(member_id(heads[i + 1])), t) end
          end
          i = i + 1
          if free <= 0 or #grants >= HANDOFF_MAX then
            stop = true
            break
          end
        end
      end
      -- heads[1 .. i - 1] are gone; heads[i], if fetched, is the lane's head now (tag f)
      gone_in[lane] = (gone_in[lane] or 0) + i - 1
      if i > #heads then state = 'empty' end
      if vt ~= vt0 then adm_set('vt:' .. r, string.format('%.0f', vt)) end
      if state ~= 'open' then
        left_fair(lane, old_f)
        if state == 'big' then
          if rsv and member_lane(rsv) == lane then adm_set('rsv:' .. r, nil) end
          redis.call('ZADD', K_BIG, weight_of(member_id(heads[i])), lane)
        end
      elseif f ~= old_f then
        redis.call('ZREM', K_FAIR, fair_member(lane, old_f))
        redis.call('ZADD', K_FAIR, 0, fair_member(lane, f))
        adm_set('f:' .. lane, pad20(f))
      end
    end
  end
  if #gone > 0 then
    redis.call('ZREM', K_LANES, unpack(gone))
    redis.call('ZREM', K_WAITERS, unpack(gone))
  end
  if #grants > 0 then
    local token = next_tokens(now, #grants)
    local expires = now + cfg.lease_ms
    local members, wakes = {}, new_wakes()
    for k, id in ipairs(grants) do
      members[#members + 1] = expires
      members[#members + 1] = id
      add_wake(wakes, id, id .. '=' .. string.format('%.0f', token + k - 1))
    end
    add_leases(members, extra)
    send_wakes(wakes, cfg)
    redis.call('HINCRBY', K_STATS, 'granted', #grants)
    redis.call('HINCRBY', K_STATS, 'handed_off', #grants)
  end
  if dropped > 0 then
    -- of the heads dropped, those heavier than the ceiling are refused (dead or not: a waiter
    -- whose entry expired would be refused as it parked again); granted heads never weigh that
    local refused = {}
    for _, m in ipairs(gone) do
      local id = member_id(m)
      if weight_of(id) > cfg.ceiling then refused[#refused + 1] = id end
    end
    if dropped > #refused then
      redis.call('HINCRBY', K_STATS, 'abandoned_waiters', dropped - #refused)
    end
    refuse_heads(now, cfg, refused)
  end
  adm_flush()
  return #grants, #gone, granted_units
end

-- Waiters heavier than the gate can ever hold: the ceiling in force was lowered after they
-- parked (an arrival that heavy is refused by acquire: status 5). Such a head is refused as that
-- arrival would be (the client raises the same ConfigError), and its lane moves on: ids (already
-- removed from lanes and waiters) are recorded in fg:{G}:evicted as '<id>=c' for 2 x waiter_ms,
-- so a pod that missed the wake '<id>=c<ceiling>' learns of it from its heartbeat (reply field
-- too_heavy), and counted in stats too_heavy.
refuse_heads = function(now, cfg, ids)
  if #ids == 0 then return end
  local until_, c = now + 2 * cfg.waiter_ms, string.format('%.0f', cfg.ceiling)
  local records, wakes = {}, new_wakes()
  for _, id in ipairs(ids) do
    records[#records + 1] = until_
    records[#records + 1] = id .. '=c'
    add_wake(wakes, id, id .. '=c' .. c)
  end
  redis.call('ZADD', K_EVICTED, unpack(records))
  send_wakes(wakes, cfg)
  redis.call('HINCRBY', K_STATS, 'too_heavy', #ids)
end

-- Lanes of big whose head weighs more than the ceiling (it was lowered while they waited there)
-- refuse their heads (refuse_heads): at most REFUSE_LANES lanes and REFUSE_HEADS heads of each
-- per call; a lane with more such heads stays in big, scored by the next one, for the next
-- call. A lane whose new head fits the limit is re-admitted by the readmit that follows.
-- handoff refuses such heads of the fair order as it meets them. Returns the refusals.
local REFUSE_LANES, REFUSE_HEADS = 16, 16
local function refuse_big(now, cfg)
  local c = string.format('%.0f', cfg.ceiling)
  local lanes = redis.call('ZRANGEBYSCORE', K_BIG, '(' .. c, '+inf', 'LIMIT', 0, REFUSE_LANES)
  if #lanes == 0 then return 0 end
  local members, ids = {}, {}
  for _, lane in ipairs(lanes) do
    local lo, hi = lane_range(lane)
    for _, m in ipairs(redis.call('ZRANGEBYLEX', K_LANES, lo, hi, 'LIMIT', 0, REFUSE_HEADS)) do
      local id = member_id(m)
      if weight_of(id) <= cfg.ceiling then break end
      members[#members + 1] = m
      ids[#ids + 1] = id
    end
  end
  remove_waiters(members)  -- a lane left in big is scored by its new head
  refuse_heads(now, cfg, ids)
  return #ids
end

-- Reap, refuse heads heavier than the ceiling, re-admit lanes that fit the limit now, then move
-- the wait list: the epilogue of the rare transitions (cancel, set_target, publish). Returns
-- (limit, grants made); handoff has written the adm fields.
local function settle(now, cfg)
  reap(now)
  refuse_big(now, cfg)
  local lim = current_limit(now, cfg)
  readmit(lim)
  return lim, handoff(now, cfg, lim)
end
