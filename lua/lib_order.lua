-- Shared library (lib_*.lua, see lib_gate.lua): the admission order's layout -- members,
-- lanes, the fair order's entries, the adm cache -- and what a grant costs a lane.

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

-- A lease id: '<pod>:<n>' then, each only when it applies, 'b<R>' (its band, for a priority
-- other than 0), 'w<W>' (its weight, above 1), 't<T>' (the tokens it holds). id_tags gives
-- {weight, band, tokens}, parsed once per call (TAGS); an id that ends in ':<n>' (digits only
-- after its last colon) has none of the tags: weight 1, band '100' (priority 0), no tokens.
local function id_tags(id)
  local t = TAGS[id]
  if t then return t end
  if string.find(id, ':%d+$') then
    t = {1, '100', 0}
  else
    -- the band a lease was granted in (band shares count by it, lib_share.lua): R of its
    -- 'b<R>' (the client tags a call of a priority other than 0; acquire.lua checks the tag
    -- against the call's class), else '100'. Tokens: what it holds of the gate's token budget
    -- (a lease resized, resize.lua, changes its id to say its new tokens, so what any id holds
    -- is always in it: adoption after a restart counts it exactly).
    local w = string.match(id, ':%d+b?%d*w(%d+)t?%d*$')
    local k = string.find(id, 't', 1, true) and string.match(id, ':%d+b?%d*w?%d*t(%d+)$')
    t = {w and tonumber(w) or 1,
      string.find(id, 'b', 1, true) and string.match(id, ':%d+b(%d%d%d)w?%d*t?%d*$') or '100',
      k and tonumber(k) or 0}
  end
  TAGS[id] = t
  return t
end

local function weight_of(id)
  return id_tags(id)[1]
end

local function band_of(id)
  return id_tags(id)[2]
end

local function tokens_asked(id)
  return id_tags(id)[3]
end

-- The lease id of a waiter member '<tenant>}<R>}<seq20>}<id>': after its last brace (tenant
-- names and ids hold none; the fixed widths of R and seq found first, the pattern otherwise).
local function member_id(m)
  local p = string.find(m, '}', 1, true)
  if p and string.byte(m, p + 4) == 125 and string.byte(m, p + 25) == 125
      and not string.find(m, '}', p + 26, true) then
    return string.sub(m, p + 26)
  end
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
  if cls == nil or cls == '' then return '}100' end  -- (the default lane)
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

-- The first entries of the fair order, read once per call: FAIR = {list = the first #list
-- members, complete = whether that is all of them, parsed = its entries parsed (fair_parse),
-- kept in parsed[j] by whoever parses them}; a read asks at least 8 (the few lanes of most gates:
-- all of them). Every write to K_FAIR goes through fair_moved, which keeps the list true, so a
-- call that reads it (each turn of a hand-off, the deadline estimates of each request it parks,
-- retry_full) asks Redis only when the list no longer holds n.
local function fair_top(n)
  local c = FAIR
  if c == nil or not (c.complete or #c.list >= n) then
    local want = math.max(n, 8)
    local list = redis.call('ZRANGEBYLEX', K_FAIR, '-', '+', 'LIMIT', 0, want)
    c = {list = list, complete = #list < want, parsed = {}}
    FAIR = c
  end
  return c.list
end

-- Whether fair member a sorts before b in the fair order: by bytes, as the sorted set orders
-- them (Lua's < follows the server's locale).
local function fair_less(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

-- A fair member left (old, nil: none) and one entered (new, nil: none) the fair order, both
-- written already: FAIR follows -- old leaves the list, new enters it where it sorts if that is
-- within what the list holds -- or is dropped when it cannot tell.
local function fair_moved(old, new)
  local c = FAIR
  if c == nil then return end
  local list = c.list
  c.parsed = {}
  if old then
    local at = nil
    for j, e in ipairs(list) do
      if e == old then at = j break end
    end
    if at then
      table.remove(list, at)
    elseif not c.complete and #list > 0 and fair_less(old, list[#list]) then
      FAIR = nil  -- (it should have been there)
      return
    end
  end
  if new and (c.complete or (#list > 0 and fair_less(new, list[#list]))) then
    local at = #list + 1
    for j, e in ipairs(list) do
      if e == new then return end
      if fair_less(new, e) then
        at = j
        break
      end
    end
    table.insert(list, at, new)
  end
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

-- What granting the head with lease id costs its lane of tenant t: its tokens when it asks some
-- (tenants of a band share a token budget by tokens), else its weight.
local function head_cost(id, t)
  local k = tokens_asked(id)
  if k > 0 then return cost(k, t) end
  return cost(weight_of(id), t)
end
