-- Shared library (lib_*.lua, see lib_gate.lua): the drain of each band -- how fast its waiters
-- are granted -- and what it says of when a new arrival would start (deadline-aware admission,
-- docs/admission.md).
--
-- adm 'dr:<R>' = '<s>,<w>,<at>': s counts the grants to waiters of band R, each weighted by
-- exp(-age / DRAIN.TAU_MS); w is the time they were counted over, weighted the same way (ms);
-- at is when they were last moved (server ms). s / w is the band's recent rate of grants. The
-- time between two hand-offs counts up to DRAIN.GAP_MS, or four mean intervals if that is
-- longer: a longer gap is time with nobody of the band waiting, when no rate was measured (a
-- drain that seems to stop while the band waits lowers the rate, within that bound).
-- DRAIN.STALE_MS: a history older than this starts again (3 x TAU_MS). HISTORY: weighted grants
-- a band needs before its rate is used (no estimate, so no refusal, before). NO_DEADLINE_MS: a
-- wait of this many ms or more is no deadline (the client sends 24 h for deadline=None). (One
-- table, not five locals: the main chunk of library + acquire is short of Lua's 200 locals.)
local DRAIN = {TAU_MS = 10000, GAP_MS = 2000, STALE_MS = 30000, HISTORY = 20,
  NO_DEADLINE_MS = 86400000, last = {}}

local function drain_parse(v)
  if not v then return 0, 0, 0 end
  local s, w, at = string.match(v, '^([^,]+),([^,]+),([^,]+)$')
  return num(s, 0), num(w, 0), num(at, 0)
end

-- The band's (s, w) moved to now: the counted part of the time since at decays both.
local function drain_aged(now, s, w, at)
  local gap = math.max(DRAIN.GAP_MS, s > 0 and 4 * w / s or 0)
  local dt = math.min(math.max(0, now - at), gap)
  local d = math.exp(-dt / DRAIN.TAU_MS)
  return s * d, w * d + DRAIN.TAU_MS * (1 - d)
end

-- k waiters of band r were granted at now. A history older than DRAIN.STALE_MS starts again.
local function drain_note(now, r, k)
  local key = 'dr:' .. r
  local s, w, at = drain_parse(adm_get(key))
  if now - at > DRAIN.STALE_MS then
    s, w = 0, 0
  else
    s, w = drain_aged(now, s, w, at)
  end
  adm_set(key, string.format('%.6g,%.6g,%.0f', s + k, w, now))
end

-- Grants per ms to waiters of band r now; nil before DRAIN.HISTORY grants were counted, or when
-- the band's last grant is older than DRAIN.STALE_MS (the load it measured may be gone).
-- (A function of now and the band's field alone: the last answer per band is kept, DRAIN.last,
-- for the next ask in the same ms -- each request a call parks asks it.)
local function drain_rate(now, r)
  local v = adm_get('dr:' .. r)
  local last = DRAIN.last[r]
  if last and last[1] == now and last[2] == v then return last[3] end
  local s, w, at = drain_parse(v)
  local rate = nil
  if s >= DRAIN.HISTORY and w > 0 and now - at <= DRAIN.STALE_MS then
    s, w = drain_aged(now, s, w, at)
    rate = s / w
  end
  DRAIN.last[r] = {now, v, rate}
  return rate
end

-- The ms by which `ahead` waiters are likely granted at `rate` per ms: ahead + sqrt(ahead) (one
-- standard deviation of a Poisson count of grants) over the rate, so a call whose deadline lies
-- just past the mean estimate is refused rather than left to wait it out about half the time
-- (benchmarks/flood.py on 2026-12-03, by the mean alone: 3 % of the calls waited out).
local function start_bound(ahead, rate)
  return math.ceil((ahead + math.sqrt(ahead)) / rate)
end

-- Expected ms until a new arrival of lane (band r, tenant t) starts: the waiters served before
-- it over the grant rate of the bands at or above r (start_bound). Ahead of it: every waiter of
-- a higher band; of another lane j of its band, as many as fair queuing serves there while its own lane serves
-- its q + 1 (q of its lane already wait: count(lane)), at the tenants' weights; nil without
-- drain history for band r. count(lane) gives a lane's waiters (the caller caches them).
local function expected_start(now, lane, r, t, count)
  local rate = drain_rate(now, r)
  if rate == nil or rate <= 0 then return nil end
  local q = count(lane)
  local ahead, seen = q + 1, {[r] = true}
  -- the first 64 lanes of band r and above (the fair order sorts by band first)
  local fair = fair_top(64)
  local parsed = FAIR.parsed
  for j = 1, math.min(#fair, 64) do
    local p = parsed[j]
    if p == nil then
      local l, _, b = fair_parse(fair[j])
      p = {l, b}
      parsed[j] = p
    end
    local other, band = p[1], p[2]
    if band > r then break end
    if other ~= lane then
      local n = count(other)
      if band ~= r then
        ahead = ahead + n
        if not seen[band] then
          seen[band] = true
          rate = rate + (drain_rate(now, band) or 0)
        end
      else
        local share = tenant_weight(lane_tenant(other)) / tenant_weight(t)
        ahead = ahead + math.min(n, math.ceil((q + 1) * share))
      end
    end
  end
  return start_bound(ahead, rate)
end

-- When a caller refused because the wait list is full (of band r) should come back, in ms: once
-- the wait list has drained by one place for it and one for each caller refused before it that
-- is not due back yet -- 'adm rj' = '<n>,<at>': n such callers at server time at, who come back
-- at the same rate -- so callers refused together come back spread over the time the queue
-- needs to drain for them, not together. The rate: the drain of band r and of every band with
-- eligible waiters (a grant of any band frees a place). nil without a measured drain.
local function retry_full(now, r)
  local rate = drain_rate(now, r) or 0
  local seen = {[r] = true}
  local fair = fair_top(64)
  for j = 1, math.min(#fair, 64) do
    local band = string.sub(fair[j], 1, 3)
    if not seen[band] then
      seen[band] = true
      rate = rate + (drain_rate(now, band) or 0)
    end
  end
  if rate <= 0 then return nil end
  local n, at = 0, now
  local v = adm_get('rj')
  if v then n, at = num(string.match(v, '^([^,]+)'), 0), num(string.match(v, ',(.+)$'), now) end
  n = math.max(0, n - math.max(0, now - at) * rate) + 1
  adm_set('rj', string.format('%.3f,%.0f', n, now))
  return math.ceil(n / rate)
end

-- The mean hold (ms) of band r's leases: its units held over its grant rate (Little's law,
-- held = rate x hold, for leases of weight 1; weighted leases make it longer by their mean
-- weight); nil without a measured drain. units: the gate's units held (nil: read here); band
-- 100 holds what the other bands do not (lib_units.lua adm_bands).
local function band_hold(now, r, units)
  local rate = drain_rate(now, r)
  if rate == nil or rate <= 0 then return nil end
  local held = adm_bands('held', r == '100' and (units or true))
  return math.ceil((held[r] or 0) / rate)
end

-- The estimate of a call of lane (band r): (start, hold) = the ms until it is expected to start
-- (expected_start) and the ms of its band's expected hold that its deadline must cover too (the
-- gate's deadline_admission 'finish': band_hold; else 0); nil when the gate does not admit by
-- deadline, behind the recovery fence (its end, not the drain, says when grants start), or
-- without drain history. count(lane) gives the waiters ahead of it in its lane, count(other)
-- another lane's; units: the gate's units held (nil: read when needed).
local function deadline_estimate(now, cfg, lane, r, count, units)
  if not cfg.deadline_admission or cfg.fence > now then return nil end
  local start = expected_start(now, lane, r, lane_tenant(lane), count)
  if start == nil then return nil end
  local hold = 0
  if cfg.deadline_finish then hold = band_hold(now, r, units) or 0 end
  return start, hold
end

-- The one rule of an arrival (acquire.lua) and of a parked waiter (the heartbeat): a call that
-- may wait wait_ms is refused when its estimate (deadline_estimate) passes that. No deadline,
-- no refusal.
local function past_deadline(start, hold, wait_ms)
  return start ~= nil and wait_ms < DRAIN.NO_DEADLINE_MS and start + hold > wait_ms
end

-- A parked waiter (its member, and the ms it may still wait) re-estimated by its pod's heartbeat
-- (the waiters of its lane before it ahead of it): (start, hold) when it would now finish its
-- wait past its deadline (past_deadline), else nil. queued: the gate's waiters (read once per
-- heartbeat by the caller); seen: the caller's table of what this call worked out per band (its
-- rate and hold, worked out once). No command while even the whole wait list would drain in time
-- at its band's rate (start_bound of queued + 1 bounds expected_start from above).
local function late_waiter(now, cfg, member, remaining, queued, seen)
  if not cfg.deadline_admission or cfg.fence > now or remaining >= DRAIN.NO_DEADLINE_MS then
    return nil
  end
  local lane = member_lane(member)
  if lane == nil then return nil end
  local r = lane_band(lane)
  local band = seen[r]
  if band == nil then
    band = {rate = drain_rate(now, r) or false, hold = 0}
    if band.rate and cfg.deadline_finish then band.hold = band_hold(now, r, nil) or 0 end
    -- (queued is the heartbeat's: one bound per band)
    band.bound = band.rate and start_bound(queued + 1, band.rate) + band.hold
    seen[r] = band
  end
  local rate, hold = band.rate, band.hold
  if not rate then return nil end
  if band.bound <= remaining then return nil end
  local before = nil
  local function count(l)
    if l == lane then
      before = before or redis.call('ZLEXCOUNT', K_LANES, '[' .. lane .. '}', '(' .. member)
      return before
    end
    local lo, hi = lane_range(l)
    return redis.call('ZLEXCOUNT', K_LANES, lo, hi)
  end
  local start
  start, hold = deadline_estimate(now, cfg, lane, r, count, nil)
  if past_deadline(start, hold, remaining) then return start, hold end
  return nil
end
