-- Shared library (lib_*.lua, see lib_gate.lua): the arrival (acquire.lua; its header states the
-- wire), as named stages over one per-call context c:
--   validate  the classes and band tags of the requests (before anything is written);
--   releases  the leases given back, and the reports they bring (observe, settle_tags);
--   config    the configuration, the recovery fence and the limit in force;
--   counts    the units, tokens and waiters held, read at once; the free units go to the
--             waiters first;
--   classify  each request in order: refused (never grantable, or by a bound while it cannot
--             be granted at once), granted now, or parked (room made by reaping or evicting);
--   write     fencing tokens and seqs, the new leases and waiters, the reply;
--   hand_off  free units the call's parks or reaps left go to the waiters now;
--   stats     the gate's counters, the wakes of evicted waiters, the adm cache written.
-- The stages and the rules they use live in one table (one local of the library's chunk: Lua
-- allows 200, tests/lua/test_lua_limits.py keeps room), shared by the EVAL form and the library.
local ACQ = {}

-- The context of one call: ARGV's layout (n leases to release from index 16, then m report
-- values, then the requests, 3 values each from `first`), and what the stages learn.
function ACQ.context(args)
  local n_release = tonumber(args[15])
  local n_obs = tonumber(args[16 + n_release])
  return {
    args = args, n_release = n_release, n_obs = n_obs,
    first = 17 + n_release + n_obs,  -- ARGV index of the first request
    released = 0, now = 0, cfg = false, fenced = false, lim = 0, tlim = nil,
    units = 0, tokens = 0, queued = 0,
    -- reaped once per call: leases when a request does not fit, waiters when the list is full;
    -- loop_reaped: a reap in classify freed units or removed waiters
    leases_reaped = false, waiters_reaped = false, loop_reaped = false,
    -- the fair order's top band (read when needed, again after a reap or eviction changed it)
    -- and the highest band of this call's parks (band_on_top)
    fair_top = nil, fair_known = false, parked_top = nil,
    -- waiters per lane and per tenant in Redis (read once per call), and those this call parks
    -- (per lane, with the lane's first id; per tenant)
    lane_len = {}, tenant_len = {}, parked_in = {}, first_id = {}, tenant_parked = {},
    pending = {},  -- band -> units of this call's grants (not in the held counts yet)
    wakes = nil, n_evicted = 0,
    -- per request j: status, n (units held, waiters, or the bound that refused it), lane,
    -- estimate; retry_in[j]: ms after which a request refused as full should return
    status = {}, n = {}, lanes = {}, ests = {}, retry_in = {},
    n_granted = 0, n_parked = 0, n_rejected = 0, refused = {},  -- refused: status -> count
    extra = 0, granted_tokens = 0,  -- of this call's grants: sum of (weight - 1), tokens
  }
end

-- A class the client library would never send is refused before anything is written: it would
-- make lane members that sort and parse wrongly; so is an id whose band tag is not its class's
-- (the held counts of the band shares go by the tag).
function ACQ.validate(c)
  local args = c.args
  for i = c.first + 2, #args, 3 do
    local cls = args[i]
    local ok = cls == '' or string.match(cls, '^%d%d%d}[^}]*$')
    if not ok or tonumber(string.sub(cls, 1, 3) .. '0') > 2000 then
      error('fleetgate: request class ' .. cls .. ' is not <100 - priority as 3 digits>}<tenant>')
    end
    if band_of(args[i - 2]) ~= lane_band(class_lane(cls)) then
      error('fleetgate: lease id ' .. args[i - 2] .. ' does not carry the band of its class '
        .. cls .. ' (b<R> after <pod>:<n> for a priority other than 0)')
    end
  end
end

-- The leases given back (release.lua's rule) and the reports of their calls.
function ACQ.releases(c)
  local args, n_release = c.args, c.n_release
  if n_release > 0 then
    c.released = remove_leases(args, 16, 15 + n_release)
    if c.released > 0 then redis.call('HINCRBY', K_STATS, STAT.RELEASED, c.released) end
  end
  observe(args, 17 + n_release, 16 + n_release + c.n_obs)
  settle_tags(args, 17 + n_release, 16 + n_release + c.n_obs)
end

-- The configuration (the caller's defaults registered for a gate without one), the recovery
-- fence (behind it nothing is granted at once: every request parks or is refused), the limit.
function ACQ.config(c)
  local a, now = c.args, now_ms()
  local cfg = load_cfg(now, {a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11],
    a[12], a[13]}, true)
  gate_birth(now, cfg, num(a[14], 0))
  c.now, c.cfg, c.fenced = now, cfg, cfg.fence > now
  c.lim, c.tlim = current_limit(now, cfg), cfg.tlim
end

-- Expired leases reaped (once per call); returns whether units or tokens were freed.
function ACQ.reap_held(c)
  c.leases_reaped = true
  local freed, freed_tokens = reap_leases(c.now)
  c.units, c.tokens = c.units - freed, c.tokens - freed_tokens
  return freed + freed_tokens > 0
end

-- The adm fields this call needs, in one read: the extra units, the tokens held, the held
-- counts (lib_units.lua adm_bands), and the tag of each lane asked for (a lane in the fair order
-- has waiters: its callers park behind them), with its band's drain under deadline admission.
-- Then the units, tokens and waiters; a gate found full reaps its expired leases, and free units
-- go to the waiters before any arrival.
function ACQ.counts(c)
  local args, fields, asked = c.args, {'extra', 'tok', 'held'}, {}
  for i = c.first, #args, 3 do
    local lane = class_lane(args[i + 2])
    if not asked[lane] then
      asked[lane] = true
      fields[#fields + 1] = 'f:' .. lane
      if c.cfg.deadline_admission then fields[#fields + 1] = 'dr:' .. lane_band(lane) end
    end
  end
  local got = redis.call('HMGET', K_ADM, unpack(fields))
  for k = 3, #fields do ADM[fields[k]] = got[k] end
  c.units, c.tokens = units_held(got[1]), tokens_held(got[2])
  c.queued = redis.call('ZCARD', K_WAITERS)
  if c.units >= c.lim or (c.tlim and c.tokens >= c.tlim) then ACQ.reap_held(c) end
  if c.queued > 0 and c.units < c.lim then
    local _, removed, units, tokens = handoff(c.now, c.cfg, c.lim, c.units, c.tokens)
    c.units, c.tokens, c.queued = c.units + units, c.tokens + tokens, c.queued - removed
  end
end

-- The band of the first eligible lane (nil: none): the fair order's or this call's own parks',
-- whichever is higher.
function ACQ.band_on_top(c)
  if not c.fair_known then
    c.fair_known = true
    local e = redis.call('ZRANGEBYLEX', K_FAIR, '-', '+', 'LIMIT', 0, 1)
    c.fair_top = nil
    if #e > 0 then c.fair_top = string.sub(e[1], 1, 3) end
  end
  local parked, fair = c.parked_top, c.fair_top
  if parked and (fair == nil or parked < fair) then return parked end
  return fair
end

function ACQ.lane_count(c, lane)
  local n = c.lane_len[lane]
  if n == nil then
    local lo, hi = lane_range(lane)
    n = redis.call('ZLEXCOUNT', K_LANES, lo, hi)
    c.lane_len[lane] = n
  end
  return n
end

function ACQ.tenant_count(c, t)
  local n = c.tenant_len[t]
  if n == nil then
    n = redis.call('ZLEXCOUNT', K_LANES, '[' .. t .. '}', '(' .. t .. '~')
    c.tenant_len[t] = n
  end
  return n + (c.tenant_parked[t] or 0)
end

-- The status and bound of a request that can never be granted (weight w, tokens tk, band r):
-- heavier than the ceiling or its band's share of it, or more tokens than the token ceiling;
-- nil otherwise.
function ACQ.never_fits(c, w, tk, r)
  local cfg = c.cfg
  if w > cfg.ceiling then return ST.TOO_HEAVY, cfg.ceiling end
  local share_c = SHARES and share_ceiling(r, cfg.ceiling)  -- (nil without shares)
  if share_c and w > share_c then return ST.OVER_SHARE, share_c end
  if cfg.token_ceiling and tk > cfg.token_ceiling then
    return ST.TOO_MANY_TOKENS, cfg.token_ceiling
  end
  return nil
end

-- Whether a waiter comes before a request of lane (band r): its lane waits in the fair order,
-- an eligible lane of its band or above waits, its own lane has waiters (no passing), the
-- recovery fence holds, or this call parked one of its lane already.
function ACQ.blocked(c, lane, r)
  local blocked = false
  if c.queued > 0 then
    blocked = adm_get('f:' .. lane) ~= nil
    if not blocked then
      local top = ACQ.band_on_top(c)
      blocked = (top ~= nil and top <= r) or ACQ.lane_count(c, lane) > 0
    end
  end
  return blocked or c.fenced or c.parked_in[lane] ~= nil
end

-- Whether w more units of band r and tk more tokens fit the limit, the token budget and the
-- band shares.
function ACQ.fits(c, w, tk, r)
  return c.units + w <= c.lim and (c.tlim == nil or c.tokens + tk <= c.tlim)
    and (SHARES == nil or share_fits(share_tally(c.units, c.pending), r, w, c.lim))
end

-- Grant w units and tk tokens of band r at once if they fit (after reaping the expired leases
-- once, when they do not): the units held, or nil.
function ACQ.grant(c, w, tk, r)
  if not ACQ.fits(c, w, tk, r) then
    if c.leases_reaped then return nil end
    c.loop_reaped = ACQ.reap_held(c) or c.loop_reaped
    if not ACQ.fits(c, w, tk, r) then return nil end
  end
  if r ~= '100' then c.pending[r] = (c.pending[r] or 0) + w end
  c.units, c.tokens = c.units + w, c.tokens + tk
  c.extra, c.granted_tokens = c.extra + w - 1, c.granted_tokens + tk
  return c.units
end

-- The newest waiter of the lowest band below band r leaves (Overloaded): the tail of that
-- band's lane with the largest tag (its most-served tenant). Returns whether one left.
function ACQ.evict(c, r)
  local last = redis.call('ZREVRANGEBYLEX', K_FAIR, '+', '-', 'LIMIT', 0, 1)
  if #last == 0 then return false end
  local lane, _, band = fair_parse(last[1])
  if band <= r then return false end
  local lo, hi = lane_range(lane)
  local tail = redis.call('ZREVRANGEBYLEX', K_LANES, hi, lo, 'LIMIT', 0, 1)
  if #tail == 0 then return false end
  local id = member_id(tail[1])
  remove_waiters({tail[1]})
  c.fair_known = false  -- its lane may have left the fair order
  if c.lane_len[lane] then c.lane_len[lane] = c.lane_len[lane] - 1 end
  local t = lane_tenant(lane)
  if c.tenant_len[t] then c.tenant_len[t] = c.tenant_len[t] - 1 end
  redis.call('ZADD', K_EVICTED, c.now + 2 * c.cfg.waiter_ms, id)
  c.wakes = c.wakes or new_wakes()
  add_wake(c.wakes, id, id .. '=' .. WAKE.EVICTED)
  c.n_evicted = c.n_evicted + 1
  return true
end

-- A request (at ARGV[i], lane, band r) that waits rather than being granted at once: the
-- status and bound of its refusal by a bound -- shed_below, the tenant's queue bound, its
-- deadline by the drain (deadline-aware admission, lib_drain.lua) -- or nil, and its estimate
-- (start, hold; nil: none).
function ACQ.refuse_waiting(c, i, lane, r)
  local cfg = c.cfg
  if 100 - tonumber(r) < cfg.shed_below then return ST.SHED, cfg.shed_below end
  if cfg.max_queued_per_tenant < cfg.max_queued
      and ACQ.tenant_count(c, lane_tenant(lane)) >= cfg.max_queued_per_tenant then
    return ST.REJECTED_TENANT, cfg.max_queued_per_tenant
  end
  local function count(l) return ACQ.lane_count(c, l) + (c.parked_in[l] or 0) end
  local start, hold = deadline_estimate(c.now, cfg, lane, r, count, c.units)
  if past_deadline(start, hold, tonumber(c.args[i + 1])) then
    return ST.TOO_LATE, start, start, hold
  end
  return nil, nil, start, hold
end

-- Park request j (id, lane, band r) if the wait list has room, made by reaping its expired
-- waiters (once per call) or evicting a waiter of a lower band: the status and n (waiters, or
-- the bound max_queued of a refusal).
function ACQ.park(c, j, id, lane, r)
  local cfg = c.cfg
  if c.queued >= cfg.max_queued and not c.waiters_reaped then
    c.waiters_reaped = true
    local reaped = reap_waiters(c.now)
    if reaped > 0 then
      c.loop_reaped = true
      c.queued = c.queued - reaped
      c.lane_len, c.tenant_len = {}, {}
      readmit(c.lim, c.tlim)  -- a big lane whose oversize head expired may fit now
      c.fair_known = false
    end
  end
  if c.queued >= cfg.max_queued and not ACQ.evict(c, r) then
    if cfg.deadline_admission then c.retry_in[j] = retry_full(c.now, r) end
    return ST.REJECTED, cfg.max_queued
  end
  if c.queued >= cfg.max_queued then c.queued = c.queued - 1 end
  c.queued = c.queued + 1
  if c.parked_in[lane] == nil then c.parked_in[lane], c.first_id[lane] = 0, id end
  c.parked_in[lane] = c.parked_in[lane] + 1
  local t = lane_tenant(lane)
  c.tenant_parked[t] = (c.tenant_parked[t] or 0) + 1
  return ST.PARKED, c.queued
end

-- Decide request j (at ARGV[i]): status, n, and its estimate (start, hold; nil: none).
function ACQ.decide(c, j, i)
  local id = c.args[i]
  local w, tk = weight_of(id), tokens_asked(id)
  local lane = class_lane(c.args[i + 2])
  local r = lane_band(lane)
  local st, k = ACQ.never_fits(c, w, tk, r)
  if st then return st, k, lane end
  if not ACQ.blocked(c, lane, r) then
    local units = ACQ.grant(c, w, tk, r)
    if units then return ST.GRANTED, units, lane end
  end
  local start, hold
  st, k, start, hold = ACQ.refuse_waiting(c, i, lane, r)
  if st then return st, k, lane, start, hold end
  st, k = ACQ.park(c, j, id, lane, r)
  return st, k, lane, start, hold
end

-- Decide each request in order, and count the outcomes.
function ACQ.classify(c)
  local first, cfg = c.first, c.cfg
  for i = first, #c.args, 3 do
    local j = #c.status + 1
    local st, k, lane, start, hold = ACQ.decide(c, j, i)
    c.status[j], c.n[j], c.lanes[j] = st, k, lane
    -- parked: its expected wait; refused for its deadline: the band's hold counted ('finish'),
    -- else -1
    c.ests[j] = (st == ST.PARKED and start)
      or (st == ST.TOO_LATE and cfg.deadline_finish and hold) or -1
    if st == ST.GRANTED then
      c.n_granted = c.n_granted + 1
    elseif st == ST.PARKED then
      c.n_parked = c.n_parked + 1
      -- this call's parks are eligible waiters of their band from now on
      local r = lane_band(lane)
      if big_score(c.args[i], c.lim, c.tlim) <= c.lim
          and (c.parked_top == nil or r < c.parked_top) then
        c.parked_top = r
      end
    else
      c.n_rejected = c.n_rejected + 1
      c.refused[st] = (c.refused[st] or 0) + 1
    end
  end
end

-- Tokens in request order (a batch is one arrival instant; grants and parks keep their order),
-- then every new entry of a set in one ZADD; the reply.
function ACQ.write(c)
  local now, cfg, args = c.now, c.cfg, c.args
  local out = {c.lim, cfg.lease_ms, cfg.waiter_ms, c.released, 0}
  if c.fenced then out[5] = cfg.fence - now end
  local token = 0
  if c.n_granted + c.n_parked > 0 then token = next_tokens(now, c.n_granted + c.n_parked) end
  local lease_expires = now + cfg.lease_ms
  local held, members, waiting = {}, {}, {}
  for j, st in ipairs(c.status) do
    local i = c.first + 3 * (j - 1)
    local id = args[i]
    local t, expires = 0, 0
    if st == ST.GRANTED then
      t, expires = token, lease_expires
      held[#held + 1] = expires
      held[#held + 1] = id
    elseif st == ST.PARKED then
      t = token
      expires = now + math.min(cfg.waiter_ms, tonumber(args[i + 1]))
      local m = c.lanes[j] .. '}' .. pad20(t) .. '}' .. id
      members[#members + 1] = 0
      members[#members + 1] = m
      waiting[#waiting + 1] = expires
      waiting[#waiting + 1] = m
    end
    if st == ST.GRANTED or st == ST.PARKED then
      token = token + 1
    elseif st == ST.REJECTED then
      t = c.retry_in[j] or 0
    end
    local k = #out
    out[k + 1], out[k + 2], out[k + 3], out[k + 4], out[k + 5] = st, t, c.n[j], expires, c.ests[j]
  end
  if c.n_granted > 0 then add_leases(held, c.extra, c.granted_tokens) end
  if c.n_parked > 0 then ACQ.enqueue(c, members, waiting) end
  return out
end

-- This call's waiters join their lanes. A lane with no waiter before this call's (or none left
-- after its evictions) enters the fair order with its first waiter as its head: counted before
-- this call's waiters go in.
function ACQ.enqueue(c, members, waiting)
  local new_lanes = {}
  for lane in pairs(c.parked_in) do
    if adm_get('f:' .. lane) == nil and ACQ.lane_count(c, lane) == 0 then
      new_lanes[#new_lanes + 1] = lane
    end
  end
  redis.call('ZADD', K_LANES, unpack(members))
  redis.call('ZADD', K_WAITERS, unpack(waiting))
  for _, lane in ipairs(new_lanes) do lane_enter(lane, c.first_id[lane], c.lim, c.tlim) end
end

-- A park of this call may have put a head that fits first (a lighter lane of a band whose
-- heavier head parked earlier in the call), and a reap in classify (for a request that did not
-- fit, then parked or was refused) may have freed units or removed a head: the free units go
-- to the waiters now, not at the next call.
function ACQ.hand_off(c)
  if (c.n_parked > 0 or c.loop_reaped) and c.units < c.lim then
    handoff(c.now, c.cfg, c.lim, c.units, c.tokens)
  end
end

-- The stats field each refusal counts in, besides STAT.REJECTED, in the order they are written.
ACQ.REFUSAL_STATS = {
  {STAT.REJECTED_TENANT, ST.REJECTED_TENANT}, {STAT.SHED, ST.SHED},
  {STAT.TOO_HEAVY, ST.TOO_HEAVY, ST.TOO_MANY_TOKENS, ST.OVER_SHARE}, {STAT.TOO_LATE, ST.TOO_LATE},
}

function ACQ.stats(c)
  if c.n_granted > 0 then redis.call('HINCRBY', K_STATS, STAT.GRANTED, c.n_granted) end
  if c.n_parked > 0 then redis.call('HINCRBY', K_STATS, STAT.PARKED, c.n_parked) end
  if c.n_rejected > 0 then
    redis.call('HINCRBY', K_STATS, STAT.REJECTED, c.n_rejected)
    for _, s in ipairs(ACQ.REFUSAL_STATS) do
      local k = 0
      for x = 2, #s do k = k + (c.refused[s[x]] or 0) end
      if k > 0 then redis.call('HINCRBY', K_STATS, s[1], k) end
    end
  end
  if c.n_evicted > 0 then
    send_wakes(c.wakes, c.cfg)
    redis.call('HINCRBY', K_STATS, STAT.EVICTED, c.n_evicted)
  end
  adm_flush()
end

-- acquire.lua: the stages in order; returns the reply.
function ACQ.run(args)
  local c = ACQ.context(args)
  ACQ.validate(c)
  ACQ.releases(c)
  ACQ.config(c)
  ACQ.counts(c)
  ACQ.classify(c)
  local out = ACQ.write(c)
  ACQ.hand_off(c)
  ACQ.stats(c)
  return out
end
