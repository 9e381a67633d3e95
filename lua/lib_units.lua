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
    redis.call('HDEL', K_ADM, 'extra')
    extra = 0
  end
  return n + extra
end

-- Add granted leases: members = {expires, id, ...}, extra = sum of (weight - 1) of their ids.
local function add_leases(members, extra)
  if extra > 0 then redis.call('HINCRBY', K_ADM, 'extra', extra) end
  redis.call('ZADD', K_HOLDERS, unpack(members))
end

-- Remove the lease ids ids[i..j]; returns (leases removed, units freed). An id already gone
-- frees nothing.
local function remove_leases(ids, i, j)
  local heavy = false
  for k = i, j do
    if string.find(ids[k], 'w', 1, true) and weight_of(ids[k]) > 1 then
      heavy = true
      break
    end
  end
  if not heavy then
    local n = redis.call('ZREM', K_HOLDERS, unpack(ids, i, j))
    return n, n
  end
  local n, units = 0, 0
  for k = i, j do
    if redis.call('ZREM', K_HOLDERS, ids[k]) == 1 then
      n = n + 1
      units = units + weight_of(ids[k])
    end
  end
  if units > n and redis.call('HINCRBY', K_ADM, 'extra', n - units) == 0 then
    redis.call('HDEL', K_ADM, 'extra')  -- no field is left once every heavy lease is gone
  end
  return n, units
end

-- The client-observed signal (fleetgate/observed.py): args[i..j] are (field, increment) pairs
-- the client summed over the reports of the calls it releases in this script call (outcome
-- counts, latency count and sum, latency buckets). Best effort: pcall, so a broken obs key
-- (wrong type, a value that is no integer) never fails the release it travels with.
local function observe(args, i, j)
  for k = i, j - 1, 2 do
    redis.pcall('HINCRBY', K_OBS, args[k], args[k + 1])
  end
end
