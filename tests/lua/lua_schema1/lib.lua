-- fleetgate shared library: prepended to every gate script when it is loaded (scripts.py), so the
-- rules for time, limit, reaping and hand-off are written once.
--
-- KEYS[1] is the gate's base name, '<prefix>:{<gate>}' (fleetgate.keys.GateKeys.base); every key
-- of the gate is that base plus a fixed suffix (the same names as GateKeys, checked by
-- tests/test_scripts.py::test_scripts_write_only_the_keys_gate_keys_names). One name costs the
-- client less to encode than ten (the "+ gate KEYS/ARGV" row of benchmarks/uncontended.py);
-- every derived key shares the base's hash tag, so it lives in the slot the call is routed to.
-- On Cluster the client declares the data keys too (fleetgate._redis.RedisMode.script_keys).
-- The wake list of a pod is K_WAKE .. pod_id.
local K_CFG, K_TARGET, K_HOLDERS, K_QUEUE, K_WAITERS, K_SEQ, K_STATS, K_PODS, K_UTIL, K_WAKE
local function use_gate(base)
  K_CFG, K_TARGET, K_HOLDERS = base .. ':cfg', base .. ':target', base .. ':holders'
  K_QUEUE, K_WAITERS, K_SEQ = base .. ':queue', base .. ':waiters', base .. ':seq'
  K_STATS, K_PODS, K_UTIL = base .. ':stats', base .. ':pods', base .. ':util'
  K_WAKE = base .. ':wake:'
end
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

-- A gate's settings without configuration or caller defaults, and their lower bounds: the same
-- as fleetgate.settings.GateSettings (tests/test_settings.py runs this against the struct).
local DEFAULT = {floor = 1, ceiling = 512, max_queued = 1000, lease_ms = 10000, waiter_ms = 5000}
local LOWEST = {floor = 1, ceiling = 1, max_queued = 0, lease_ms = 100, waiter_ms = 100}
local CFG_FIELDS = {'floor', 'ceiling', 'max_queued', 'lease_ms', 'waiter_ms'}

-- Field i (name) of the stored configuration v, else of the caller's defaults d, else DEFAULT;
-- raised to LOWEST.
local function cfg_field(v, d, i, name)
  return math.max(LOWEST[name], math.floor(num(v[i], num(d[i], DEFAULT[name]))))
end

-- The gate's configuration in force. Missing fields take the caller's defaults (d, optional:
-- floor, ceiling, max_queued, lease_ms, waiter_ms), then DEFAULT; values below LOWEST are raised
-- to it, and the ceiling to the floor: half-written or garbled configuration never fails a call.
-- register: a gate with no configuration at all gets the caller's defaults stored (a client may
-- register defaults only where none exist; the coordinator's publish overwrites them).
local function load_cfg(d, register)
  d = d or {}
  local v = redis.call('HMGET', K_CFG, unpack(CFG_FIELDS))
  if register and not (v[1] or v[2] or v[3] or v[4] or v[5]) then
    local pairs_ = {}
    for i, name in ipairs(CFG_FIELDS) do
      if d[i] ~= nil then
        pairs_[#pairs_ + 1] = name
        pairs_[#pairs_ + 1] = d[i]
      end
    end
    if #pairs_ > 0 then redis.call('HSET', K_CFG, unpack(pairs_)) end
  end
  local cfg = {
    floor = cfg_field(v, d, 1, 'floor'),
    max_queued = cfg_field(v, d, 3, 'max_queued'),
    lease_ms = cfg_field(v, d, 4, 'lease_ms'),
    waiter_ms = cfg_field(v, d, 5, 'waiter_ms'),
  }
  cfg.ceiling = math.max(cfg.floor, cfg_field(v, d, 2, 'ceiling'))
  return cfg
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

-- Remove up to REAP_MAX expired leases; returns how many. Called where they matter: by an
-- acquire that finds the gate full, and by every heartbeat and sweep (so an expired lease of a
-- gate below its limit, which blocks nobody, goes within a heartbeat period).
local function reap_leases(now)
  local leases = redis.call('ZRANGEBYSCORE', K_HOLDERS, '-inf', now, 'LIMIT', 0, REAP_MAX)
  if #leases > 0 then
    redis.call('ZREM', K_HOLDERS, unpack(leases))
    redis.call('HINCRBY', K_STATS, 'expired_leases', #leases)
  end
  return #leases
end

-- Remove up to REAP_MAX expired waiters; returns how many. Called by an acquire that finds the
-- wait list full, and by every heartbeat and sweep; a dead head is also dropped by handoff.
local function reap_waiters(now)
  local waiters = redis.call('ZRANGEBYSCORE', K_WAITERS, '-inf', now, 'LIMIT', 0, REAP_MAX)
  if #waiters > 0 then
    redis.call('ZREM', K_WAITERS, unpack(waiters))
    redis.call('ZREM', K_QUEUE, unpack(waiters))
    redis.call('HINCRBY', K_STATS, 'abandoned_waiters', #waiters)
  end
  return #waiters
end

local function reap(now)
  return reap_leases(now) + reap_waiters(now)
end

-- Wake-ups of one call, grouped by pod: one RPUSH (and PEXPIRE) per pod, not per id. Ids are
-- '<pod-id>:<n>'; the pod id is everything before the last colon.
local function new_wakes()
  return {pods = {}, ids = {}}
end

local function add_wake(wakes, id)
  local pod = string.match(id, '^(.*):[^:]*$')
  if pod then
    local ids = wakes.ids[pod]
    if ids == nil then
      ids = {}
      wakes.ids[pod] = ids
      wakes.pods[#wakes.pods + 1] = pod
    end
    ids[#ids + 1] = id
  end
end

local function send_wakes(wakes, cfg)
  for _, pod in ipairs(wakes.pods) do
    local key = K_WAKE .. pod
    redis.call('RPUSH', key, unpack(wakes.ids[pod]))
    -- A dead pod's list disappears by itself; a live pod pops it long before this.
    redis.call('PEXPIRE', key, cfg.waiter_ms * 2)
  end
end

-- Hand free slots to the head waiters, in FIFO order, and wake their pods. holders: the
-- current ZCARD of the holders if the caller knows it. Returns (grants made, heads removed:
-- granted or dropped). A head whose waiter entry has expired (its pod died or stopped refreshing
-- it) is dropped, not granted: when more waiters die at once than one reap removes, the freed
-- slots would otherwise sit with dead owners for a lease TTL. Dropped heads are bounded per call
-- like reaping.
local function handoff(now, cfg, lim, holders)
  local free = lim - (holders or redis.call('ZCARD', K_HOLDERS))
  if free <= 0 then return 0, 0 end
  if free > HANDOFF_MAX then free = HANDOFF_MAX end
  local expires = now + cfg.lease_ms
  local granted, dropped = 0, 0
  local members, wakes = {}, new_wakes()
  while granted < free and dropped < DROP_MAX do
    local heads = redis.call('ZRANGE', K_QUEUE, 0, free - granted - 1)
    if #heads == 0 then break end
    local until_ = redis.call('ZMSCORE', K_WAITERS, unpack(heads))
    redis.call('ZREM', K_QUEUE, unpack(heads))
    redis.call('ZREM', K_WAITERS, unpack(heads))
    for i, id in ipairs(heads) do
      local w = tonumber(until_[i])
      if w ~= nil and w > now then
        members[#members + 1] = expires
        members[#members + 1] = id
        add_wake(wakes, id)
        granted = granted + 1
      else
        dropped = dropped + 1
      end
    end
  end
  if granted > 0 then
    redis.call('ZADD', K_HOLDERS, unpack(members))
    send_wakes(wakes, cfg)
    redis.call('HINCRBY', K_STATS, 'granted', granted)
    redis.call('HINCRBY', K_STATS, 'handed_off', granted)
  end
  if dropped > 0 then redis.call('HINCRBY', K_STATS, 'abandoned_waiters', dropped) end
  return granted, granted + dropped
end

-- The first of k new fencing tokens (also the FIFO sequence of a parked caller), k >= 1: the
-- call's tokens are first .. first + k - 1. Monotonic per gate, also across a Redis restart: a
-- counter that has to start again (INCRBY made it k) starts from server time x 1000 instead,
-- above any token issued before unless the gate issued more than 1000 per millisecond on average
-- since its counter was born. Holders raise it above their own tokens (raise_seq) after a
-- rollback that kept the counter.
local SEQ_PER_MS = 1000
local function next_tokens(now, k)
  local t = redis.call('INCRBY', K_SEQ, k)
  if t == k then
    t = now * SEQ_PER_MS + k - 1
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

-- Reap, then move the queue: the prologue of the rare transitions (cancel, target, adoption).
local function settle(now, cfg)
  reap(now)
  local lim = current_limit(now, cfg)
  handoff(now, cfg, lim)
  return lim
end
