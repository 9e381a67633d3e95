-- Shared library (lib_*.lua, see lib_gate.lua): lanes entering and leaving the fair order
-- (and big), and waiters leaving their lanes.

-- The start of a lane whose head (lease id, tenant t) has tag f: f minus the head's cost, never
-- below 0 -- the cost is taken at the tenant's weight now, and a publish may have changed it
-- since the tag was made (the tag would go negative and no longer parse). c: that cost, if the
-- caller has it already.
local function start_of(f, id, t, c)
  return math.max(0, f - (c or head_cost(id, t)))
end

-- A lane's score in big: the limit its head needs (its weight, or more under a band share:
-- share_need), plus BIG_TOKENS when that fits the limit but its tokens do not fit the token
-- budget (readmit looks at the two kinds apart).
local BIG_TOKENS = 2 ^ 40
local function big_score(id, lim, tlim)
  local w = share_need(id)
  if w <= lim and tlim and tokens_asked(id) > tlim then return w + BIG_TOKENS end
  return w
end

-- A lane that became backlogged (or left big): it enters the fair order at its band's virtual
-- time (no credit for idle time), or big if its head (lease id) weighs more than the limit or
-- asks more tokens than the token budget (tlim, nil: none).
lane_enter = function(lane, head, lim, tlim)
  local score = big_score(head, lim, tlim)
  if score > lim then
    redis.call('ZADD', K_BIG, score, lane)
    return
  end
  local f = num(adm_get('vt:' .. lane_band(lane)), 0) + head_cost(head, lane_tenant(lane))
  local m = fair_member(lane, f)
  redis.call('ZADD', K_FAIR, 0, m)
  fair_moved(nil, m)
  adm_set('f:' .. lane, pad20(f))
end

-- A lane left the fair order: when it was the band's last, the band's virtual time goes too
-- (an idle band starts again from 0: no credit is kept for anyone).
local function left_fair(lane, f)
  local m = fair_member(lane, f)
  redis.call('ZREM', K_FAIR, m)
  fair_moved(m, nil)
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
      redis.call('ZADD', K_BIG, share_need(member_id(left[1])), lane)
    end
  end
end

-- A lane's tag fell to f by a settlement: a reservation of its band held by a lane with a
-- larger tag goes (the next hand-off, in this call when there are free units, chooses by tags
-- again and the head it chooses reserves); arrivals never take reserved units anyway, they park
-- behind the band's waiters.
local function unreserve_behind(lane, f)
  local key = 'rsv:' .. lane_band(lane)
  local rsv = adm_get(key)
  local rlane = rsv and member_lane(rsv)
  local rf = rlane and rlane ~= lane and num(adm_get('f:' .. rlane), nil)
  if rf and f < rf then
    ADM[key] = false
    redis.call('HDEL', K_ADM, key)
  end
end

-- Settlement (lease.report(tokens=used), fleetgate/observed.py): a grant charged its lane the
-- tokens the call asked; its release brings what the call used, summed per class as the pair
-- ('vc:<class>', used - asked) among args[i..j]. While the lane is in the fair order its tag
-- moves by the difference at the tenant's weight -- later for a lane whose calls used more than
-- they asked, sooner for one that asked too much -- never below its band's virtual time (no
-- credit beyond what a lane joining now would get). A lane that left the fair order keeps
-- nothing: it starts again from the band's time, as every idle lane does.
local function settle_tags(args, i, j)
  for k = i, j - 1, 2 do
    local cls = string.match(args[k], '^vc:(.*)$')
    local d = cls and num(args[k + 1], 0) or 0
    if d ~= 0 and (cls == '' or string.match(cls, '^%d%d%d}[^}]*$')) then
      local lane = class_lane(cls)
      local f = num(adm_get('f:' .. lane), nil)
      if f then
        local c = cost(math.abs(d), lane_tenant(lane))
        if d < 0 then c = -c end
        local nf = math.max(num(adm_get('vt:' .. lane_band(lane)), 0), f + c)
        local old_m, new_m = fair_member(lane, f), fair_member(lane, nf)
        redis.call('ZREM', K_FAIR, old_m)
        redis.call('ZADD', K_FAIR, 0, new_m)
        fair_moved(old_m, new_m)
        -- written now, not at the script's end: an error later in the call (a script is not
        -- rolled back) must not leave the fair order and the tag apart
        ADM['f:' .. lane] = pad20(nf)
        redis.call('HSET', K_ADM, 'f:' .. lane, ADM['f:' .. lane])
        unreserve_behind(lane, nf)
      end
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

-- Lanes of big whose head now fits under the limit (and the token budget tlim) enter the fair
-- order (bounded per call); a head that fits the limit but not the budget is scored so.
local function readmit(lim, tlim)
  local lanes = redis.call('ZRANGEBYSCORE', K_BIG, '-inf', lim, 'LIMIT', 0, 16)
  if tlim then
    local more = redis.call('ZRANGEBYSCORE', K_BIG, BIG_TOKENS, BIG_TOKENS + lim, 'LIMIT', 0, 16)
    for _, lane in ipairs(more) do lanes[#lanes + 1] = lane end
  end
  for _, lane in ipairs(lanes) do
    local lo, hi = lane_range(lane)
    local head = redis.call('ZRANGEBYLEX', K_LANES, lo, hi, 'LIMIT', 0, 1)
    if #head == 0 then
      redis.call('ZREM', K_BIG, lane)
    elseif big_score(member_id(head[1]), lim, tlim) <= lim then
      redis.call('ZREM', K_BIG, lane)
      lane_enter(lane, member_id(head[1]), lim, tlim)
    else
      redis.call('ZADD', K_BIG, big_score(member_id(head[1]), lim, tlim), lane)
    end
  end
end
