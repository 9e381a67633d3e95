-- Shared library (lib_*.lua, see lib_gate.lua): moving the wait list -- the hand-off of free
-- units to waiters, the refusal of heads heavier than the ceiling, and settle.

-- Grants handed to head waiters per call; a larger limit jump is finished by the next calls.
local HANDOFF_MAX = 256
-- Dead heads (expired waiter entries) a hand-off drops per call: the release that hands off does
-- not reap first, so this bounds the reaping of dead heads and their dropping together.
local DROP_MAX = 2 * REAP_MAX

local refuse_heads  -- defined below, after handoff (which calls it)

-- The lane the next turn of a hand-off serves, as a table: lane, its tag f, bound (the tag of
-- the best other lane of its band, nil: alone), r (the band), rsv (the band's reserved head, if
-- any), t (the lane's tenant); nil when nobody waits. The band's smallest tag wins, unless the
-- band holds a reservation (a head the free units wait for), whose lane is served first.
local function next_turn()
  local top = redis.call('ZRANGEBYLEX', K_FAIR, '-', '+', 'LIMIT', 0, 2)
  if #top == 0 then return nil end
  local lane, f, r = fair_parse(top[1])
  local bound = nil
  if #top > 1 then
    local _, f2, r2 = fair_parse(top[2])
    if r2 == r then bound = f2 end
  end
  adm_prefetch('rsv:' .. r, 'vt:' .. r, 'dr:' .. r)  -- (dr: the band's drain, drain_note)
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
  return {lane = lane, f = f, bound = bound, r = r, rsv = rsv, t = lane_tenant(lane)}
end

-- The turn's reserved head is gone (granted or dropped): the band has no reservation.
local function unreserve(turn, m)
  if turn.rsv == m then
    adm_set('rsv:' .. turn.r, nil)
    turn.rsv = nil
  end
end

-- Whether the waiter (lease id) can never be granted under cfg: it weighs more than the ceiling
-- or than its band's share of it (lib_share.lua), or asks more tokens than the token ceiling
-- (each lowered after it parked).
local function too_heavy(cfg, id)
  local w = weight_of(id)
  return w > cfg.ceiling
    or (cfg.token_ceiling ~= nil and tokens_asked(id) > cfg.token_ceiling)
    or (SHARES ~= nil and w > (share_ceiling(band_of(id), cfg.ceiling) or w))
end

-- Serve the turn's lane from heads[1 .. last] (alive: their waiter entries' expiry) into the
-- pass h (free units and tokens, grants, gone, extra, tokens, dropped, granted_units). Moves
-- turn.f (the tag of the lane's next head) and, shared with other lanes, the band's virtual time
-- vt. Returns the index of the first head not taken, how the turn ended ('open': the lane may be
-- served again, 'big': that head weighs more than the limit or asks more tokens than the budget,
-- 'reserved': the free units and tokens wait for that head, 'full': no free units or grants left
-- for the pass; the last two end the pass), and vt.
local function serve_heads(now, cfg, lim, h, turn, heads, alive, last, vt)
  local t, bound = turn.t, turn.bound
  -- Alone in its band (no other eligible lane), a lane is served without moving the band's
  -- virtual time or its own start: relative to each other, a lane that joins later (at
  -- vt + its cost) and this one (at vt + its head's cost) are where they would be had both
  -- moved, and a gate used with defaults writes neither tags nor times per grant.
  local alone = bound == nil
  local i = 1
  while i <= last do
    local m = heads[i]
    local id = member_id(m)
    local w, k = weight_of(id), tokens_asked(id)
    local expires = tonumber(alive[i])
    -- a head heavier than the ceiling (lowered after it parked) can never be granted: it is
    -- dropped as a dead one is, and refused by the pass (refuse_heads)
    if expires == nil or expires <= now or too_heavy(cfg, id) then
      h.gone[#h.gone + 1] = m
      h.dropped = h.dropped + 1
      unreserve(turn, m)
      -- the next head takes the dropped one's turn
      if i < #heads then
        turn.f = start_of(turn.f, id, t) + head_cost(member_id(heads[i + 1]), t)
      end
      i = i + 1
      if h.dropped >= DROP_MAX then break end
    elseif share_need(id) > lim or (cfg.tlim and k > cfg.tlim) then
      return i, 'big', vt
    elseif bound and turn.f > bound and turn.rsv ~= m then
      break  -- another lane of the band has the smaller tag now (before any reservation:
             -- only the chosen head, the band's smallest tag, reserves)
    elseif w > h.free or k > h.tfree or not share_fits(h.sh, turn.r, w, lim) then
      -- the free units wait for it: nobody of its band or below passes it (a band share it
      -- does not fit keeps them for the higher bands meanwhile)
      adm_set('rsv:' .. turn.r, m)
      return i, 'reserved', vt
    else
      h.gone[#h.gone + 1] = m
      h.grants[#h.grants + 1] = id
      h.extra = h.extra + w - 1
      h.free = h.free - w
      h.tfree = h.tfree - k
      h.tokens = h.tokens + k
      h.granted_units = h.granted_units + w
      h.served[turn.r] = (h.served[turn.r] or 0) + 1
      share_take(h.sh, turn.r, w)
      unreserve(turn, m)
      local nxt = i < #heads and head_cost(member_id(heads[i + 1]), t)
      if alone then
        if nxt then turn.f = start_of(turn.f, id, t) + nxt end
      else
        if turn.f > vt then vt = turn.f end
        if nxt then turn.f = vt + nxt end
      end
      i = i + 1
      if h.free <= 0 or #h.grants >= HANDOFF_MAX then return i, 'full', vt end
    end
  end
  return i, 'open', vt
end

-- One turn of a hand-off: serve the lane next_turn chose, then move its tag in the fair order
-- (or take it out: emptied, or its head too big for the limit). Returns true when the pass ends.
local function hand_turn(now, cfg, lim, h, turn)
  local lane, old_f = turn.lane, turn.f
  local want = math.min(h.free, HANDOFF_MAX - #h.grants)
  -- with other lanes in the band this lane serves a few before the tags are compared again
  if turn.bound and want > 8 then want = 8 end
  local lo, hi = lane_range(lane)
  local skip = h.gone_in[lane] or 0  -- its head prefix already removed in this pass
  local heads = redis.call('ZRANGEBYLEX', K_LANES, lo, hi, 'LIMIT', skip, want + 1)
  if turn.rsv and member_lane(turn.rsv) == lane and heads[1] ~= turn.rsv then
    -- the reserved waiter left its lane: serve by tags again (the next turn looks again)
    adm_set('rsv:' .. turn.r, nil)
    return false
  end
  local alive = {}
  if #heads > 0 then alive = redis.call('ZMSCORE', K_WAITERS, unpack(heads)) end
  local vt0 = num(adm_get('vt:' .. turn.r), 0)
  local last = math.min(#heads, want)
  local i, ended, vt = serve_heads(now, cfg, lim, h, turn, heads, alive, last, vt0)
  -- heads[1 .. i - 1] are gone; heads[i], if fetched, is the lane's head now (tag turn.f)
  h.gone_in[lane] = skip + i - 1
  if vt ~= vt0 then adm_set('vt:' .. turn.r, string.format('%.0f', vt)) end
  if ended == 'big' or i > #heads then  -- the lane leaves the fair order: too big, or empty
    left_fair(lane, old_f)
    if ended == 'big' then
      if turn.rsv and member_lane(turn.rsv) == lane then adm_set('rsv:' .. turn.r, nil) end
      redis.call('ZADD', K_BIG, big_score(member_id(heads[i]), lim, cfg.tlim), lane)
    end
  elseif turn.f ~= old_f then
    redis.call('ZREM', K_FAIR, fair_member(lane, old_f))
    redis.call('ZADD', K_FAIR, 0, fair_member(lane, turn.f))
    adm_set('f:' .. lane, pad20(turn.f))
  end
  return ended == 'reserved' or ended == 'full'
end

-- The end of a hand-off pass h: the heads it took leave the wait list; the granted ones become
-- leases (tokens, wakes to their pods, stats); of the dropped ones, those heavier than the
-- ceiling are refused (dead or not: a waiter whose entry expired would be refused as it parked
-- again; granted heads never weigh that), the others counted as abandoned.
local function finish_pass(now, cfg, h)
  if #h.gone > 0 then
    redis.call('ZREM', K_LANES, unpack(h.gone))
    redis.call('ZREM', K_WAITERS, unpack(h.gone))
  end
  local grants = h.grants
  if #grants > 0 then
    local token = next_tokens(now, #grants)
    local expires = now + cfg.lease_ms
    local members, wakes = {}, new_wakes()
    for k, id in ipairs(grants) do
      members[#members + 1] = expires
      members[#members + 1] = id
      add_wake(wakes, id, id .. '=' .. string.format('%.0f', token + k - 1))
    end
    add_leases(members, h.extra, h.tokens)
    send_wakes(wakes, cfg)
    redis.call('HINCRBY', K_STATS, 'granted', #grants)
    redis.call('HINCRBY', K_STATS, 'handed_off', #grants)
    if cfg.deadline_admission then
      for r, k in pairs(h.served) do drain_note(now, r, k) end
    end
  end
  if h.dropped > 0 then
    local refused = {}
    for _, m in ipairs(h.gone) do
      local id = member_id(m)
      if too_heavy(cfg, id) then refused[#refused + 1] = id end
    end
    if h.dropped > #refused then
      redis.call('HINCRBY', K_STATS, 'abandoned_waiters', h.dropped - #refused)
    end
    refuse_heads(now, cfg, refused)
  end
end

-- Hand free units to waiters and wake their pods: the top band first (strict), within it the
-- lane with the smallest tag (fair queuing across tenants), FIFO within a lane; a head that does
-- not fit stops everything and keeps the free units (reserved for it: no passing); a head
-- heavier than the limit moves its lane to big. A dead head (its waiter entry expired) is
-- dropped. Bounded per call: HANDOFF_MAX grants, DROP_MAX drops. units: the units held if the
-- caller knows them, tokens: the tokens held, likewise. Returns (grants, waiters removed, units
-- granted, tokens granted).
local function handoff(now, cfg, lim, units, tokens)
  local free = lim - (units or units_held())
  if free <= 0 or cfg.fence > now then  -- full, or behind the recovery fence (gate_birth)
    adm_flush()
    return 0, 0, 0, 0
  end
  local tfree = math.huge
  if cfg.tlim then tfree = cfg.tlim - (tokens or tokens_held()) end
  local h = {free = free, tfree = tfree, grants = {}, gone = {}, extra = 0, tokens = 0,
             dropped = 0, granted_units = 0, served = {},
             gone_in = {},  -- lane -> members of it already removed (its head prefix)
             sh = share_tally(lim - free)}  -- served: band -> its waiters granted (their
                                            -- drain); sh: the band shares' units (nil: none)
  local turns = 0
  while #h.grants < HANDOFF_MAX and h.dropped < DROP_MAX and turns < 2 * HANDOFF_MAX do
    turns = turns + 1
    local turn = next_turn()
    if turn == nil or hand_turn(now, cfg, lim, h, turn) then break end
  end
  finish_pass(now, cfg, h)
  adm_flush()
  return #h.grants, #h.gone, h.granted_units, h.tokens
end

-- Waiters heavier than the gate can ever hold: the ceiling in force was lowered after they
-- parked (an arrival that heavy is refused by acquire: TOO_HEAVY). Such a head is refused as that
-- arrival would be (the client raises the same ConfigError), and its lane moves on: ids (already
-- removed from lanes and waiters) are recorded in fg:{G}:evicted as '<id>=c' for 2 x waiter_ms,
-- so a pod that missed the wake '<id>=c<ceiling>' learns of it from its heartbeat (reply field
-- too_heavy), and counted in stats too_heavy.
-- A waiter refused for its tokens (more than the token ceiling K) is woken with '<id>=k<K>', one
-- heavier than its band's share of the ceiling (S units, lib_share.lua) with '<id>=s<S>'.
refuse_heads = function(now, cfg, ids)
  if #ids == 0 then return end
  local until_, c = now + 2 * cfg.waiter_ms, string.format('%.0f', cfg.ceiling)
  local records, wakes = {}, new_wakes()
  for _, id in ipairs(ids) do
    records[#records + 1] = until_
    records[#records + 1] = id .. '=c'
    local w = weight_of(id)
    if w > cfg.ceiling then
      add_wake(wakes, id, id .. '=' .. WAKE.TOO_HEAVY .. c)
    elseif SHARES ~= nil and w > (share_ceiling(band_of(id), cfg.ceiling) or w) then
      local sc = share_ceiling(band_of(id), cfg.ceiling)
      add_wake(wakes, id, id .. '=' .. WAKE.OVER_SHARE .. string.format('%.0f', sc))
    else
      add_wake(wakes, id, id .. '=' .. WAKE.TOO_MANY_TOKENS
        .. string.format('%.0f', cfg.token_ceiling))
    end
  end
  redis.call('ZADD', K_EVICTED, unpack(records))
  send_wakes(wakes, cfg)
  redis.call('HINCRBY', K_STATS, 'too_heavy', #ids)
end

-- Lanes of big whose head weighs more than the ceiling, or asks more tokens than the token
-- ceiling (either lowered while they waited there), refuse their heads (refuse_heads): at most
-- REFUSE_LANES lanes of each kind and REFUSE_HEADS heads of each lane per call; a lane with more
-- such heads stays in big, scored by the next one, for the next call. A lane whose new head fits
-- the limit is re-admitted by the readmit that follows. handoff refuses such heads of the fair
-- order as it meets them. Returns the refusals.
local REFUSE_LANES, REFUSE_HEADS = 16, 16
local function refuse_big(now, cfg)
  local c = string.format('%.0f', cfg.ceiling)
  local lanes = redis.call('ZRANGEBYSCORE', K_BIG, '(' .. c, '(' .. BIG_TOKENS, 'LIMIT', 0,
    REFUSE_LANES)
  if cfg.tlim then  -- heads whose tokens do not fit the budget (big_score)
    local more = redis.call('ZRANGEBYSCORE', K_BIG, BIG_TOKENS, '+inf', 'LIMIT', 0, REFUSE_LANES)
    for _, lane in ipairs(more) do lanes[#lanes + 1] = lane end
  end
  if #lanes == 0 then return 0 end
  local members, ids = {}, {}
  for _, lane in ipairs(lanes) do
    local lo, hi = lane_range(lane)
    for _, m in ipairs(redis.call('ZRANGEBYLEX', K_LANES, lo, hi, 'LIMIT', 0, REFUSE_HEADS)) do
      local id = member_id(m)
      if not too_heavy(cfg, id) then break end
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
  readmit(lim, cfg.tlim)
  return lim, handoff(now, cfg, lim)
end
