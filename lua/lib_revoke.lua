-- Shared library (lib_*.lua, see lib_gate.lua): revocation, taking units back from lower bands
-- cooperatively (docs/admission.md "Revocation").
--
-- A gate with revoke_after (cfg.revoke_after, ms) asks for units back when the head of the
-- highest waiting band has waited that long and still does not fit: adm 'rd' =
-- '<R>=<units>,...', the units each band strictly below it should give back, lowest band first,
-- never more than the head lacks beyond the units of the leases already revoked and still held.
-- Every heartbeat of the gate recomputes it (revoke_demand); the holders' heartbeats answer it
-- (revoke_leases): each marks its own leases of those bands, newest first (the client sends its
-- leases in that order), until the band's demand is met, and tells its pod which of its leases
-- are revoked. A mark is a member '<id>=v' of K_EVICTED scored REVOKED_MARK (never due by time:
-- it lasts while the lease is held; marks of leases gone are dropped by the next heartbeat of
-- the gate, or with the gate's other keys by prune.lua). adm 'rv' is set while marks may exist:
-- with it unset and nobody waiting, a heartbeat looks for neither marks nor a head.
-- A mark frees nothing: a revoked lease holds its units until it is released or its TTL lapses,
-- so the cap holds whatever its holder does (a frozen holder stops renewing, and its lease
-- lapses).
local REVOKED_MARK = 4503599627370496  -- 2^52: above any server time in ms

-- Write the demand d (band -> units; lib_units.lua bands_field) to adm 'rd'.
local function store_demand(d)
  local v = bands_field(d)
  if v ~= nil or adm_get('rd') then adm_set('rd', v) end
end

-- The units of the revoked leases still held, per band and in all; the marks of leases gone
-- (released, expired) are dropped, and adm 'rv' (set while a mark may exist) follows: cleared
-- once none is left, set again if marks are found without it.
local function revoked_held()
  local marks = redis.call('ZRANGEBYSCORE', K_EVICTED, REVOKED_MARK, REVOKED_MARK)
  local by_band, total = {}, 0
  local ids = {}
  for i, m in ipairs(marks) do ids[i] = string.sub(m, 1, -3) end
  local held = #ids > 0 and redis.call('ZMSCORE', K_HOLDERS, unpack(ids)) or {}
  local gone = {}
  for i, id in ipairs(ids) do
    if held[i] then
      local b, w = band_of(id), weight_of(id)
      by_band[b] = (by_band[b] or 0) + w
      total = total + w
    else
      gone[#gone + 1] = marks[i]
    end
  end
  if #gone > 0 then redis.call('ZREM', K_EVICTED, unpack(gone)) end
  local left = #gone < #marks
  if left ~= (adm_get('rv') ~= nil) then adm_set('rv', left and '1' or false) end
  return by_band, total
end

-- The demand of the gate now (adm 'rd', written): the head of the first lane of the fair order
-- (the highest band with eligible waiters) that has waited revoke_after or more and lacks units
-- asks them of the bands strictly below its band, lowest band first, each for at most what it
-- holds unrevoked. lim: the limit in force; waiting: the gate's waiters (ZCARD waiters). Nothing
-- without revoke_after (no command). With nobody waiting and no mark (adm 'rv' unset) it only
-- reads adm 'rd' and 'rv' (one HMGET) and clears a demand left by a head gone. While a mark may
-- exist, the marks of leases gone are dropped at every heartbeat of the gate (revoked_held); a
-- holder is told of its revoked leases by revoke_leases, whether anyone waits or not.
local function revoke_demand(now, cfg, lim, waiting)
  if cfg.revoke_after == nil then return end
  adm_prefetch('rd', 'rv')
  local rv_band, rv_total = {}, 0
  if waiting > 0 or adm_get('rv') then rv_band, rv_total = revoked_held() end
  local d, top = {}, {}
  if waiting > 0 then top = fair_top(1) end
  if #top > 0 then
    local lane, _, band = fair_parse(top[1])
    local lo, hi = lane_range(lane)
    local head = redis.call('ZRANGEBYLEX', K_LANES, lo, hi, 'LIMIT', 0, 1)
    -- a waiter's seq is at least its park time x SEQ_PER_MS (lib_tokens.lua): now - seq /
    -- SEQ_PER_MS never over-states how long it has waited
    local seq = #head > 0 and num(string.match(head[1], '}(%d+)}[^}]*$'), nil)
    if seq and now - seq / SEQ_PER_MS >= cfg.revoke_after then
      local units = units_held(nil)
      local need = weight_of(member_id(head[1])) - (lim - units) - rv_total
      if need > 0 then
        local held = adm_bands('held', units)  -- (and band 100's)
        local below = {}
        for b, _ in pairs(held) do
          if b > band then below[#below + 1] = b end
        end
        table.sort(below, function(a, b) return a > b end)  -- the lowest band first
        for _, b in ipairs(below) do
          local take = math.min(held[b] - (rv_band[b] or 0), need)
          if take > 0 then
            d[b] = take
            need = need - take
          end
          if need <= 0 then break end
        end
      end
    end
  end
  store_demand(d)
end

-- The pod's leases held now (ids, newest first as its client sends them) against the demand:
-- those marked revoked already and those this call marks go to r.revoked (the pod learns it in
-- this reply); a lease is marked while its band's demand is not met (adm 'rd' lowered by its
-- weight). Nothing without revoke_after.
local function revoke_leases(now, cfg, ids, r)
  if cfg.revoke_after == nil or #ids == 0 then return end
  local mids = {}
  for i, id in ipairs(ids) do mids[i] = id .. '=v' end
  local marked = redis.call('ZMSCORE', K_EVICTED, unpack(mids))
  local d = adm_bands('rd')
  local new = {}
  for i, id in ipairs(ids) do
    local b = band_of(id)
    if marked[i] then
      r.revoked[#r.revoked + 1] = id
    elseif (d[b] or 0) > 0 then
      d[b] = d[b] - weight_of(id)
      new[#new + 1] = REVOKED_MARK
      new[#new + 1] = mids[i]
      r.revoked[#r.revoked + 1] = id
    end
  end
  if #new > 0 then
    redis.call('ZADD', K_EVICTED, unpack(new))
    redis.call('HINCRBY', K_STATS, 'revoked', #new / 2)
    if not adm_get('rv') then adm_set('rv', '1') end
    store_demand(d)
  end
end
