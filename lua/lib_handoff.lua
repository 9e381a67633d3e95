-- Shared library (lib_*.lua, see lib_gate.lua): moving the wait list -- the hand-off of free
-- units to waiters, the refusal of heads heavier than the ceiling, and settle.

-- Grants handed to head waiters per call; a larger limit jump is finished by the next calls.
local HANDOFF_MAX = 256
-- Dead heads (expired waiter entries) a hand-off drops per call: the release that hands off does
-- not reap first, so this bounds the reaping of dead heads and their dropping together.
local DROP_MAX = 2 * REAP_MAX

local refuse_heads  -- defined below, after handoff (which calls it)

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
