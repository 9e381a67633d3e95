-- acquire: release the leases given, then for each request, in order, grant a permit now, park
-- the caller in its lane, or reject. One process sends what its callers asked while its
-- previous call was in flight as one call (fleetgate.client's group commit), so the per-call
-- costs (time, configuration, limit, counts, stats) are paid once per batch; a caller that
-- releases and acquires again costs one call.
-- KEYS: 1 the gate's base name (see lib_gate.lua)
-- ARGV: 1 floor  2 ceiling  3 max_queued  4 lease_ms  5 waiter_ms  6 max_queued_per_tenant
--       7 shed_below  8 token_limit  9 token_ceiling  10 deadline_admission (0 off, 1 start,
--       2 finish)
--       11 band_share ('<R>=<permille>,...')  12 revoke_after_ms ('' for none)
--       13 tenant weights ('name}w}...')
--       (defaults, registered only when the gate has no configuration yet), 14 fence_ms (the
--       recovery fence of a gate found without state: lib_fence.lua gate_birth; 0 for none),
--       15 n = leases to release, then n lease ids,
--       then m, then m
--       values: the released calls' reports as (field, increment) pairs for fg:{G}:obs
--       (fleetgate.observed.tally; m = 0 without reports), then per request: id ('<pod>:<n>',
--       then 'b<R>' for a priority other than 0, 'w<W>' for weight W, 't<T>' for T tokens:
--       lib_order.lua), wait_ms (time
--       the caller is willing to park, > 0),
--       class ('' = priority 0 of the default tenant, else '<R>}<tenant>' with R = 100 - priority
--       as three digits)
-- Returns {limit, lease_ms, waiter_ms, released, fence_ms, then per request: status, token, n,
--   expires_at, estimate}: released = how many of the ids given held a lease (release.lua's reply);
--   fence_ms = how long the gate's recovery fence still holds every grant (0: none), so a
--   caller that parked behind it asks for its hand-off when it ends;
--   status 1 = granted (n = units held), 2 = parked (n = waiters, this one included),
--   0 = rejected because the wait list is full (n = max_queued), 3 = rejected because the
--   tenant's waiters reached max_queued_per_tenant (n = that bound), 4 = rejected because the
--   priority is below shed_below and the call could not be granted at once (n = shed_below),
--   5 = refused: the weight is above the ceiling and can never be granted (n = ceiling),
--   6 = refused: the tokens are above the token ceiling (n = token ceiling),
--   7 = refused: by the drain of its band it would start (with deadline_admission 'finish':
--   end) after its deadline (n = the expected wait in ms; deadline-aware admission,
--   lib_drain.lua),
--   8 = refused: the weight is above its band's share of the ceiling (n = that share in units;
--   lib_share.lua).
--   token: granted = the fencing token (monotonic per gate in grant order); parked = the
--   caller's seq, its place in its lane (waiter member '<tenant>}<R>}<seq20>}<id>'): its
--   fencing token comes with the grant; rejected because the list is full (status 0) = ms
--   after which it is expected to find a place (lib_drain.lua retry_full; 0: no estimate).
--   lease_ms, waiter_ms: the TTLs in force, so the caller paces its first renewal by them.
--   expires_at: server time (ms) at which the granted lease (or the parked entry) expires.
--   estimate: parked = the ms it is expected to wait by the drain (lib_drain.lua
--   deadline_estimate); status 7 = the ms of its band's expected hold its deadline had to cover
--   too (deadline_admission 'finish'); -1 = none (no drain history, admission off, the recovery
--   fence, not 'finish', or another outcome).
-- A call is granted at once only if nobody eligible waits in its band or above and its own
-- lane is empty (no passing), and its weight fits the limit and the band shares that bind its
-- band, and its tokens the token budget. A
-- full wait list evicts the newest waiter of the lowest band below the arrival's (from that
-- band's most-served tenant; it gets Overloaded).
-- Reaping is lazy (bounded, as ever): expired leases only when a request does not fit, expired
-- waiters only when the wait list is full, i.e. when they could change the answer; heartbeats
-- and the coordinator's sweep reap the rest.
local n_release = tonumber(ARGV[15])
local n_obs = tonumber(ARGV[16 + n_release])
local first = 17 + n_release + n_obs  -- ARGV index of the first request
-- A class the client library would never send is refused before anything is written: it would
-- make lane members that sort and parse wrongly; so is an id whose band tag is not its class's
-- (the held counts of the band shares go by the tag).
for i = first + 2, #ARGV, 3 do
  local cls = ARGV[i]
  local ok = cls == '' or string.match(cls, '^%d%d%d}[^}]*$')
  if not ok or tonumber(string.sub(cls, 1, 3) .. '0') > 2000 then
    error('fleetgate: request class ' .. cls .. ' is not <100 - priority as 3 digits>}<tenant>')
  end
  if band_of(ARGV[i - 2]) ~= lane_band(class_lane(cls)) then
    error('fleetgate: lease id ' .. ARGV[i - 2] .. ' does not carry the band of its class '
      .. cls .. ' (b<R> after <pod>:<n> for a priority other than 0)')
  end
end
local released = 0
if n_release > 0 then
  released = remove_leases(ARGV, 16, 15 + n_release)
  if released > 0 then redis.call('HINCRBY', K_STATS, 'released', released) end
end
observe(ARGV, 17 + n_release, 16 + n_release + n_obs)
settle_tags(ARGV, 17 + n_release, 16 + n_release + n_obs)

local now = now_ms()
local cfg = load_cfg(now, {ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8],
  ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13]}, true)
gate_birth(now, cfg, num(ARGV[14], 0))
-- behind the recovery fence nothing is granted at once: every request parks (or is refused)
local fenced = cfg.fence > now
local lim = current_limit(now, cfg)
-- The adm fields this call needs, in one read: the extra units, the tokens held, and the tag of
-- each lane asked for (a lane in the fair order has waiters: its callers park behind them).
local tlim = cfg.tlim
local fields, asked = {'extra', 'tok', 'held'}, {}
for i = first, #ARGV, 3 do
  local lane = class_lane(ARGV[i + 2])
  if not asked[lane] then
    asked[lane] = true
    fields[#fields + 1] = 'f:' .. lane
    -- (and its band's fields the hand-off reads when the band is on top: lib_handoff next_turn)
    local r = lane_band(lane)
    fields[#fields + 1] = 'rsv:' .. r
    fields[#fields + 1] = 'vt:' .. r
    if cfg.deadline_admission then fields[#fields + 1] = 'dr:' .. r end
  end
end
local got = redis.call('HMGET', K_ADM, unpack(fields))
for k = 3, #fields do ADM[fields[k]] = got[k] end  -- (held: lib_units.lua adm_bands)
local units = units_held(got[1])
local tokens = tokens_held(got[2])
local queued = redis.call('ZCARD', K_WAITERS)
local leases_reaped, waiters_reaped = false, false
local loop_reaped = false  -- a request's reap in the loop below freed units or removed waiters
local function reap_held()
  leases_reaped = true
  local freed, freed_tokens = reap_leases(now)
  units, tokens = units - freed, tokens - freed_tokens
  return freed + freed_tokens > 0
end
if units >= lim or (tlim and tokens >= tlim) then reap_held() end
if queued > 0 and units < lim then
  local _, removed, granted_units, granted_tokens = handoff(now, cfg, lim, units, tokens)
  units, tokens, queued = units + granted_units, tokens + granted_tokens, queued - removed
end
-- whether k more tokens fit the token budget (always, without one)
local function tokens_fit(k)
  return tlim == nil or tokens + k <= tlim
end

-- The band of the first eligible lane (nil: none): the fair order's (read when needed, again
-- after a reap or eviction changed it) or this call's own parks', whichever is higher.
local fair_top, fair_known, parked_top = nil, false, nil
local function band_on_top()
  if not fair_known then
    fair_known = true
    local e = redis.call('ZRANGEBYLEX', K_FAIR, '-', '+', 'LIMIT', 0, 1)
    fair_top = nil
    if #e > 0 then fair_top = string.sub(e[1], 1, 3) end
  end
  if parked_top and (fair_top == nil or parked_top < fair_top) then return parked_top end
  return fair_top
end
-- Waiters per lane and per tenant in Redis (read once per call), and those this call parks.
local lane_len, tenant_len, parked_in, tenant_parked, first_id = {}, {}, {}, {}, {}
local function lane_count(lane)
  local n = lane_len[lane]
  if n == nil then
    local lo, hi = lane_range(lane)
    n = redis.call('ZLEXCOUNT', K_LANES, lo, hi)
    lane_len[lane] = n
  end
  return n
end
local function tenant_count(t)
  local n = tenant_len[t]
  if n == nil then
    n = redis.call('ZLEXCOUNT', K_LANES, '[' .. t .. '}', '(' .. t .. '~')
    tenant_len[t] = n
  end
  return n + (tenant_parked[t] or 0)
end

-- Deadline-aware admission (lib_drain.lua): the estimate of the request at ARGV[i] (lane, band
-- r), about to park -- (start, hold) or nil -- and whether it is refused for its deadline.
local function estimate(i, lane, r)
  local function count(l) return lane_count(l) + (parked_in[l] or 0) end
  local start, hold = deadline_estimate(now, cfg, lane, r, count, units)
  return start, hold, past_deadline(start, hold, tonumber(ARGV[i + 1]))
end

local wakes = new_wakes()
local n_evicted = 0
-- The newest waiter of the lowest band below band r leaves (Overloaded): the tail of that
-- band's lane with the largest tag (its most-served tenant). Returns whether one left.
local function evict(r)
  local last = redis.call('ZREVRANGEBYLEX', K_FAIR, '+', '-', 'LIMIT', 0, 1)
  if #last == 0 then return false end
  local lane, _, band = fair_parse(last[1])
  if band <= r then return false end
  local lo, hi = lane_range(lane)
  local tail = redis.call('ZREVRANGEBYLEX', K_LANES, hi, lo, 'LIMIT', 0, 1)
  if #tail == 0 then return false end
  local id = member_id(tail[1])
  remove_waiters({tail[1]})
  fair_known = false  -- its lane may have left the fair order
  if lane_len[lane] then lane_len[lane] = lane_len[lane] - 1 end
  local t = lane_tenant(lane)
  if tenant_len[t] then tenant_len[t] = tenant_len[t] - 1 end
  redis.call('ZADD', K_EVICTED, now + 2 * cfg.waiter_ms, id)
  add_wake(wakes, id, id .. '=x')
  n_evicted = n_evicted + 1
  return true
end

-- Decide each request in order (n: units held, waiters, or the bound that refused it).
local status, n, lanes, ests = {}, {}, {}, {}
local n_granted, n_parked, n_rejected, extra, granted_tokens = 0, 0, 0, 0, 0
local rejected_by = {0, 0, 0, 0, 0, 0, 0, 0, 0}  -- by status + 1
local retry_in = {}  -- request j -> ms after which a request refused as full should return
-- units of this call's grants per band (not in the held counts yet): what the band shares see
local pending = {}
local function share_ok(r, w)
  return SHARES == nil or share_fits(share_tally(units, pending), r, w, lim)
end
for i = first, #ARGV, 3 do
  local id, cls = ARGV[i], ARGV[i + 2]
  local w, tk = weight_of(id), tokens_asked(id)
  local lane = class_lane(cls)
  local r = lane_band(lane)
  local st, k, est_start, est_hold
  local share_c = share_ceiling(r, cfg.ceiling)
  if w > cfg.ceiling then
    st, k = 5, cfg.ceiling
  elseif share_c and w > share_c then
    st, k = 8, share_c
  elseif cfg.token_ceiling and tk > cfg.token_ceiling then
    st, k = 6, cfg.token_ceiling
  else
    local blocked = false
    if queued > 0 then
      blocked = adm_get('f:' .. lane) ~= nil  -- its lane waits in the fair order
      if not blocked then
        local top = band_on_top()
        blocked = (top ~= nil and top <= r) or lane_count(lane) > 0
      end
    end
    blocked = blocked or fenced or parked_in[lane] ~= nil
    if not blocked and (units + w > lim or not tokens_fit(tk) or not share_ok(r, w))
        and not leases_reaped then
      loop_reaped = reap_held() or loop_reaped
    end
    if not blocked and units + w <= lim and tokens_fit(tk) and share_ok(r, w) then
      if r ~= '100' then pending[r] = (pending[r] or 0) + w end
      units, tokens = units + w, tokens + tk
      extra, granted_tokens = extra + w - 1, granted_tokens + tk
      st, k = 1, units
    elseif 100 - tonumber(r) < cfg.shed_below then
      st, k = 4, cfg.shed_below
    elseif cfg.max_queued_per_tenant < cfg.max_queued
        and tenant_count(lane_tenant(lane)) >= cfg.max_queued_per_tenant then
      st, k = 3, cfg.max_queued_per_tenant
    else
      local late
      est_start, est_hold, late = estimate(i, lane, r)
      if late then st, k = 7, est_start end
    end
    if st == nil then
      if queued >= cfg.max_queued and not waiters_reaped then
        waiters_reaped = true
        local reaped = reap_waiters(now)
        if reaped > 0 then
          loop_reaped = true
          queued = queued - reaped
          lane_len, tenant_len = {}, {}
          -- a big lane whose oversize head expired may fit now
          readmit(lim, tlim)
          fair_known = false
        end
      end
      if queued >= cfg.max_queued and not evict(r) then
        st, k = 0, cfg.max_queued
        if cfg.deadline_admission then retry_in[#status + 1] = retry_full(now, r) end
      else
        if queued >= cfg.max_queued then queued = queued - 1 end
        queued = queued + 1
        st, k = 2, queued
        if parked_in[lane] == nil then parked_in[lane], first_id[lane] = 0, id end
        parked_in[lane] = parked_in[lane] + 1
        local t = lane_tenant(lane)
        tenant_parked[t] = (tenant_parked[t] or 0) + 1
      end
    end
  end
  status[#status + 1], n[#n + 1], lanes[#lanes + 1] = st, k, lane
  -- parked: its expected wait; refused for its deadline: the band's hold counted ('finish'),
  -- else -1
  ests[#ests + 1] = (st == 2 and est_start) or (st == 7 and cfg.deadline_finish and est_hold) or -1
  if st == 1 then
    n_granted = n_granted + 1
  elseif st == 2 then
    n_parked = n_parked + 1
    -- this call's parks are eligible waiters of their band from now on
    if big_score(id, lim, tlim) <= lim and (parked_top == nil or r < parked_top) then
      parked_top = r
    end
  else
    n_rejected = n_rejected + 1
    rejected_by[st + 1] = rejected_by[st + 1] + 1
  end
end

-- Tokens in request order (a batch is one arrival instant; grants and parks keep their order),
-- then every new entry of a set in one ZADD.
local out = {lim, cfg.lease_ms, cfg.waiter_ms, released, 0}
if fenced then out[5] = cfg.fence - now end
local token = 0
if n_granted + n_parked > 0 then token = next_tokens(now, n_granted + n_parked) end
local lease_expires = now + cfg.lease_ms
local held, members, waiting = {}, {}, {}
for j, st in ipairs(status) do
  local i = first + 3 * (j - 1)
  local id = ARGV[i]
  local t, expires = 0, 0
  if st == 1 then
    t, expires = token, lease_expires
    held[#held + 1] = expires
    held[#held + 1] = id
  elseif st == 2 then
    t = token
    expires = now + math.min(cfg.waiter_ms, tonumber(ARGV[i + 1]))
    local lane = lanes[j]
    local m = lane .. '}' .. pad20(t) .. '}' .. id
    members[#members + 1] = 0
    members[#members + 1] = m
    waiting[#waiting + 1] = expires
    waiting[#waiting + 1] = m
  end
  if st == 1 or st == 2 then
    token = token + 1
  elseif st == 0 then
    t = retry_in[j] or 0
  end
  local k = #out
  out[k + 1], out[k + 2], out[k + 3], out[k + 4], out[k + 5] = st, t, n[j], expires, ests[j]
end
if n_granted > 0 then
  add_leases(held, extra, granted_tokens)
  redis.call('HINCRBY', K_STATS, 'granted', n_granted)
end
if n_parked > 0 then
  -- A lane with no waiter before this call's (or none left after its evictions) enters the
  -- fair order with its first waiter as its head: counted before this call's waiters go in.
  local new_lanes = {}
  for lane in pairs(parked_in) do
    if adm_get('f:' .. lane) == nil and lane_count(lane) == 0 then
      new_lanes[#new_lanes + 1] = lane
    end
  end
  redis.call('ZADD', K_LANES, unpack(members))
  redis.call('ZADD', K_WAITERS, unpack(waiting))
  redis.call('HINCRBY', K_STATS, 'parked', n_parked)
  for _, lane in ipairs(new_lanes) do lane_enter(lane, first_id[lane], lim, tlim) end
end
-- A park of this call may have put a head that fits first (a lighter lane of a band whose
-- heavier head parked earlier in the call), and a reap in the loop (for a request that did not
-- fit, then parked or was refused) may have freed units or removed a head: the free units go
-- to the waiters now, not at the next call.
if (n_parked > 0 or loop_reaped) and units < lim then
  handoff(now, cfg, lim, units, tokens)
end
if n_rejected > 0 then redis.call('HINCRBY', K_STATS, 'rejected', n_rejected) end
if rejected_by[4] > 0 then redis.call('HINCRBY', K_STATS, 'rejected_tenant', rejected_by[4]) end
if rejected_by[5] > 0 then redis.call('HINCRBY', K_STATS, 'shed', rejected_by[5]) end
if rejected_by[6] + rejected_by[7] > 0 then
  redis.call('HINCRBY', K_STATS, 'too_heavy', rejected_by[6] + rejected_by[7])
end
if rejected_by[8] > 0 then redis.call('HINCRBY', K_STATS, 'too_late', rejected_by[8]) end
if rejected_by[9] > 0 then redis.call('HINCRBY', K_STATS, 'too_heavy', rejected_by[9]) end
if n_evicted > 0 then
  send_wakes(wakes, cfg)
  redis.call('HINCRBY', K_STATS, 'evicted', n_evicted)
end
adm_flush()
return out
