-- Shared library (lib_*.lua, see lib_gate.lua): the units a gate holds, the leases that hold
-- them (weights: lib_order.lua), and the reports their releases bring (observe).

-- Units held: holders plus the extra weight of the heavy ones (extra: HGET adm extra if the
-- caller read it already, false when absent). A counter left by a script that stopped half-way
-- (only ever an overcount) is dropped once no lease is left.
local function units_held(extra)
  local n = redis.call('ZCARD', K_HOLDERS)
  if extra == nil then extra = redis.call('HGET', K_ADM, 'extra') end
  extra = num(extra, 0)
  if extra ~= 0 and n == 0 then
    redis.call('HDEL', K_ADM, 'extra', 'held')
    ADM['held'] = false
    extra = 0
  end
  return n + extra
end

-- Tokens held (the token budget's count, lib_cfg.lua token_budget): adm 'tok', the sum of the
-- tokens of the holders, each in its id (a resized lease gets a new id: resize.lua). tok: HGET
-- adm tok if the caller read it already; n: ZCARD holders if known. As extra: raised before a
-- lease is added, lowered after it is removed, dropped once no lease is left.
local function tokens_held(tok, n)
  if tok == nil then tok = redis.call('HGET', K_ADM, 'tok') end
  tok = num(tok, 0)
  if tok ~= 0 and (n or redis.call('ZCARD', K_HOLDERS)) == 0 then
    redis.call('HDEL', K_ADM, 'tok')
    tok = 0
  end
  return tok
end

-- A units-per-band field of adm, '<R>=<units>,...' (field 'held' below; 'rd', the demand of
-- lib_revoke.lua), as a table band -> units ({} when absent). units, for 'held': the units held
-- (a number: units_held() if the caller has it; true: read here) adds band '100', the units
-- held less those of the other bands (never below 0). bands_field writes such a table back: the
-- bands with units above 0, sorted, or nil when none is left.
--
-- adm 'held', the units held per band for the band shares (lib_share.lua): each band other than
-- 100 that holds leases, counted from the band in each lease id (band_of); band 100 (priority 0)
-- holds the rest of units_held. Kept for every gate, so a share set at any time finds the
-- counts right; a gate used only at priority 0 never writes it. As extra: raised before leases
-- are added, lowered after they are removed, dropped once no lease is left.
local function adm_bands(field, units)
  local t = {}
  local v = adm_get(field)
  if v then
    for b, u in string.gmatch(v, '(%d%d%d)=(%d+)') do t[b] = tonumber(u) end
  end
  if units then
    local rest = units == true and units_held(nil) or units
    for _, u in pairs(t) do rest = rest - u end
    t['100'] = math.max(0, rest)
  end
  return t
end

local function bands_field(t)
  local parts = {}
  for b, u in pairs(t) do
    if u > 0 then parts[#parts + 1] = b .. '=' .. string.format('%.0f', u) end
  end
  if #parts == 0 then return nil end
  table.sort(parts)
  return table.concat(parts, ',')
end

-- The units of the ids among ids[i..j] (step: 1, or 2 for {expires, id, ...} from i = 2) that
-- are tagged with a band, added into d (band -> units) with the sign s; returns d.
local function held_of(ids, i, j, step, s, d)
  for k = i, j, step do
    local b = band_of(ids[k])
    if b ~= '100' then d[b] = (d[b] or 0) + s * weight_of(ids[k]) end
  end
  return d
end

-- Move the held counts by d (band -> signed units), written at once; removed: after a removal
-- (a gate left without leases drops the field, whatever it said).
local function held_move(d, removed)
  if next(d) == nil then return end
  local t = adm_bands('held')
  for b, u in pairs(d) do t[b] = math.max(0, (t[b] or 0) + u) end
  local v = bands_field(t)
  if v == nil or (removed and redis.call('ZCARD', K_HOLDERS) == 0) then
    ADM['held'] = false
    redis.call('HDEL', K_ADM, 'held')
  else
    ADM['held'] = v
    redis.call('HSET', K_ADM, 'held', v)
  end
end

-- Add granted leases: members = {expires, id, ...}, extra = sum of (weight - 1) of their ids,
-- tokens = sum of the tokens they ask.
local function add_leases(members, extra, tokens)
  if extra > 0 then redis.call('HINCRBY', K_ADM, 'extra', extra) end
  if tokens and tokens > 0 then redis.call('HINCRBY', K_ADM, 'tok', tokens) end
  held_move(held_of(members, 2, #members, 2, 1, {}))
  redis.call('ZADD', K_HOLDERS, unpack(members))
end

-- Count again a lease the gate lost while its work runs (adopt.lua, the heartbeat): its weight,
-- tokens and band, before the caller adds it (an abort in between overcounts, never under).
local function count_again(id)
  local w, k = weight_of(id), tokens_asked(id)
  if w > 1 then redis.call('HINCRBY', K_ADM, 'extra', w - 1) end
  if k > 0 then redis.call('HINCRBY', K_ADM, 'tok', k) end
  held_move(held_of({id}, 1, 1, 1, 1, {}))
end

-- Lower a counter of adm by d (>= 0) after the leases that held it were removed; the field goes
-- once it reaches 0.
local function lower_adm(field, d)
  if d > 0 and redis.call('HINCRBY', K_ADM, field, -d) <= 0 then
    redis.call('HDEL', K_ADM, field)
  end
end

-- Remove the lease ids ids[i..j]; returns (leases removed, units freed, tokens freed). An id
-- already gone frees nothing.
local function remove_leases(ids, i, j)
  local heavy = false
  for k = i, j do
    if (string.find(ids[k], 'w', 1, true) and weight_of(ids[k]) > 1) or band_of(ids[k]) ~= '100'
    then
      heavy = true  -- (or tagged with a band: the held counts move)
      break
    end
  end
  local tokened = false
  for k = i, j do
    if tokens_asked(ids[k]) > 0 then
      tokened = true
      break
    end
  end
  if not heavy and not tokened then
    local n = redis.call('ZREM', K_HOLDERS, unpack(ids, i, j))
    return n, n, 0
  end
  -- which of them hold a lease (one ZMSCORE), then those removed by one ZREM; an id given twice
  -- is removed, and counted, once
  local held = redis.call('ZMSCORE', K_HOLDERS, unpack(ids, i, j))
  local n, units, tokens, bands, gone, seen = 0, 0, 0, {}, {}, {}
  for k = i, j do
    local id = ids[k]
    if held[k - i + 1] and not seen[id] then
      seen[id] = true
      gone[#gone + 1] = id
      n = n + 1
      units = units + weight_of(id)
      tokens = tokens + tokens_asked(id)
      held_of(ids, k, k, 1, -1, bands)
    end
  end
  if n > 0 then redis.call('ZREM', K_HOLDERS, unpack(gone)) end
  lower_adm('extra', units - n)  -- no field is left once every heavy lease is gone
  lower_adm('tok', tokens)
  held_move(bands, true)
  return n, units, tokens
end

-- The client-observed signal (fleetgate/observed.py): args[i..j] are (field, increment) pairs
-- the client summed over the reports of the calls it releases in this script call (outcome
-- counts, latency count and sum, latency buckets). Best effort: pcall, so a broken obs key
-- (wrong type, a value that is no integer) never fails the release it travels with. The
-- settlement pairs ('vc:<class>', see settle_tags) are not counters: they are skipped here.
local function observe(args, i, j)
  for k = i, j - 1, 2 do
    if string.sub(args[k], 1, 3) ~= 'vc:' then
      redis.pcall('HINCRBY', K_OBS, args[k], args[k + 1])
    end
  end
end
