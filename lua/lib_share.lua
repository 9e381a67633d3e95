-- Shared library (lib_*.lua, see lib_gate.lua): headroom between bands (docs/admission.md
-- "Headroom between bands"). A band share (gate setting band_share; SHARES, parsed by
-- lib_cfg.lua) bounds what a band and the bands below it hold together: entry e = {r, p} lets
-- band e.r and every band below it hold at most share_cap(e, lim) units between them, so the
-- units above stay free for the higher bands even when none of theirs waits. A band is bound
-- by every entry at or above it (e.r <= its R). Without shares every function here is a no-op.

-- What the bands an entry binds may hold under limit lim: never below one unit (a band may
-- always run one call: a share must not shut it out at a small limit).
local function share_cap(e, lim)
  return math.max(1, math.floor(e.p * lim / 1000))
end

-- The heaviest call band r may ever hold under the ceiling c; nil: no share binds band r.
local function share_ceiling(r, c)
  local least = nil
  for _, e in ipairs(SHARES or {}) do
    if e.r <= r then
      local cap = share_cap(e, c)
      if least == nil or cap < least then least = cap end
    end
  end
  return least
end

-- The least limit under which lease id's weight fits every share binding its band: its weight
-- without shares (and for weight 1, which every share admits).
local function share_need(id)
  local w = weight_of(id)
  if SHARES == nil or w <= 1 then return w end
  local r, need = band_of(id), w
  for _, e in ipairs(SHARES) do
    if e.r <= r then need = math.max(need, math.ceil(1000 * w / e.p)) end
  end
  return need
end

-- The units the bands of each share hold: tally[k] for SHARES[k], from units (every unit held)
-- and the held counts (lib_units.lua adm_bands) plus pending (band -> units granted in this
-- call and not added yet, or nil); nil without shares. Band 100's units are the rest of units.
local function share_tally(units, pending)
  if SHARES == nil then return nil end
  local held = adm_bands('held')
  for b, u in pairs(pending or {}) do held[b] = (held[b] or 0) + u end
  local tally = {}
  for k, e in ipairs(SHARES) do
    local s = 0
    if e.r <= '100' then  -- band 100 and the bands below it: all but the higher bands' units
      s = units
      for b, u in pairs(held) do
        if b < e.r then s = s - u end
      end
    else
      for b, u in pairs(held) do
        if b >= e.r then s = s + u end
      end
    end
    tally[k] = math.max(0, s)
  end
  return tally
end

-- Whether w more units of band r fit every share binding it under limit lim (tally: share_tally;
-- always without shares).
local function share_fits(tally, r, w, lim)
  if tally == nil then return true end
  for k, e in ipairs(SHARES) do
    if e.r <= r and tally[k] + w > share_cap(e, lim) then return false end
  end
  return true
end

-- w units of band r granted: counted in the tally.
local function share_take(tally, r, w)
  if tally == nil then return end
  for k, e in ipairs(SHARES) do
    if e.r <= r then tally[k] = tally[k] + w end
  end
end
