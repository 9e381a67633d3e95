-- fleetgate shared library: prepended to every gate script when it is loaded (scripts.py), so the
-- rules for time, limit, reaping and hand-off are written once.
--
-- KEYS (the same for every gate script, built by fleetgate.keys.GateKeys.script_keys):
--   1 cfg  2 target  3 holders  4 queue  5 waiters  6 seq  7 stats  8 pods  9 util
--   10 wake-list prefix
-- All keys share the gate's hash tag; the wake list of a pod is KEYS[10] .. pod_id, in the same
-- slot, and is the only key a script derives (the owner pod is known only inside the script).
local K_CFG, K_TARGET, K_HOLDERS, K_QUEUE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_WAITERS, K_SEQ, K_STATS, K_PODS = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local K_UTIL, K_WAKE = KEYS[9], KEYS[10]

-- Expired entries removed per call, per kind. A bound keeps every call O(log n) even after a
-- mass crash; the coordinator's reaper and every later call sweep the rest.
local REAP_MAX = 64
-- Grants handed to head waiters per call; a larger limit jump is finished by the next calls.
local HANDOFF_MAX = 256

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

-- Register the caller's defaults only where the gate has no configuration yet.
local function ensure_cfg(floor, ceiling, max_queued, lease_ms, waiter_ms)
  if redis.call('EXISTS', K_CFG) == 0 then
    redis.call('HSET', K_CFG, 'floor', floor, 'ceiling', ceiling, 'max_queued', max_queued,
      'lease_ms', lease_ms, 'waiter_ms', waiter_ms)
  end
end

-- A gate's settings without configuration or caller defaults, and their lower bounds: the same
-- as fleetgate.settings.GateSettings (tests/test_settings.py runs this against the struct).
local DEFAULT = {floor = 1, ceiling = 512, max_queued = 1000, lease_ms = 10000, waiter_ms = 5000}
local LOWEST = {floor = 1, ceiling = 1, max_queued = 0, lease_ms = 100, waiter_ms = 100}

-- Field i (name) of the stored configuration v, else of the caller's defaults d, else DEFAULT;
-- raised to LOWEST.
local function cfg_field(v, d, i, name)
  return math.max(LOWEST[name], math.floor(num(v[i], num(d[i], DEFAULT[name]))))
end

-- Missing fields take the caller's defaults (d, optional: floor, ceiling, max_queued, lease_ms,
-- waiter_ms), then DEFAULT; values below LOWEST are raised to it, and the ceiling to the floor:
-- half-written or garbled configuration never fails a call.
local function load_cfg(d)
  d = d or {}
  local v = redis.call('HMGET', K_CFG, 'floor', 'ceiling', 'max_queued', 'lease_ms', 'waiter_ms')
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

local function reap(now)
  local leases = redis.call('ZRANGEBYSCORE', K_HOLDERS, '-inf', now, 'LIMIT', 0, REAP_MAX)
  if #leases > 0 then
    redis.call('ZREM', K_HOLDERS, unpack(leases))
    redis.call('HINCRBY', K_STATS, 'expired_leases', #leases)
  end
  local waiters = redis.call('ZRANGEBYSCORE', K_WAITERS, '-inf', now, 'LIMIT', 0, REAP_MAX)
  if #waiters > 0 then
    redis.call('ZREM', K_WAITERS, unpack(waiters))
    redis.call('ZREM', K_QUEUE, unpack(waiters))
    redis.call('HINCRBY', K_STATS, 'abandoned_waiters', #waiters)
  end
  return #leases + #waiters
end

-- Ids are '<pod-id>:<n>'; the pod id is everything before the last colon.
local function wake(id, cfg)
  local pod = string.match(id, '^(.*):[^:]*$')
  if pod then
    local key = K_WAKE .. pod
    redis.call('RPUSH', key, id)
    -- A dead pod's list disappears by itself; a live pod pops it long before this.
    redis.call('PEXPIRE', key, cfg.waiter_ms * 2)
  end
end

-- Hand free slots to the head waiters, in FIFO order, and wake their pods. Returns grants made.
-- A head whose waiter entry has expired (its pod died or stopped refreshing it) is dropped, not
-- granted: when more waiters die at once than one reap removes, the freed slots would otherwise
-- sit with dead owners for a lease TTL. Dropped heads are bounded per call like reaping.
local function handoff(now, cfg, lim)
  local free = lim - redis.call('ZCARD', K_HOLDERS)
  if free <= 0 then return 0 end
  if free > HANDOFF_MAX then free = HANDOFF_MAX end
  local expires = now + cfg.lease_ms
  local granted, dropped = 0, 0
  while granted < free and dropped < REAP_MAX do
    local heads = redis.call('ZRANGE', K_QUEUE, 0, free - granted - 1)
    if #heads == 0 then break end
    local until_ = redis.call('ZMSCORE', K_WAITERS, unpack(heads))
    redis.call('ZREM', K_QUEUE, unpack(heads))
    redis.call('ZREM', K_WAITERS, unpack(heads))
    for i, id in ipairs(heads) do
      local w = tonumber(until_[i])
      if w ~= nil and w > now then
        redis.call('ZADD', K_HOLDERS, expires, id)
        wake(id, cfg)
        granted = granted + 1
      else
        dropped = dropped + 1
      end
    end
  end
  if dropped > 0 then redis.call('HINCRBY', K_STATS, 'abandoned_waiters', dropped) end
  if granted > 0 then
    redis.call('HINCRBY', K_STATS, 'granted', granted)
    redis.call('HINCRBY', K_STATS, 'handed_off', granted)
  end
  return granted
end

-- The next fencing token (also the FIFO sequence of a parked caller). Monotonic per gate, also
-- across a Redis restart: a counter that has to start again (INCR made it 1) starts from server
-- time x 1000 instead, above any token issued before unless the gate issued more than 1000 per
-- millisecond on average since its counter was born. Holders raise it above their own tokens
-- (raise_seq) after a rollback that kept the counter.
local SEQ_PER_MS = 1000
local function next_token(now)
  local t = redis.call('INCR', K_SEQ)
  if t == 1 then
    t = now * SEQ_PER_MS
    redis.call('SET', K_SEQ, string.format('%.0f', t))
  end
  return t
end

local function raise_seq(token)
  if token and token > 0 then
    local s = num(redis.call('GET', K_SEQ), 0)
    if s < token then redis.call('SET', K_SEQ, string.format('%.0f', token)) end
  end
end

-- Reap, then move the queue: the prologue of every state transition.
local function settle(now, cfg)
  reap(now)
  local lim = current_limit(now, cfg)
  handoff(now, cfg, lim)
  return lim
end
