-- Shared library of the gate scripts: a gate's keys, server time, numbers.
--
-- The lib_*.lua files are one library, joined in the order LIB_PARTS declares
-- (fleetgate/scripts/_library.py): each part uses only what the parts before it define. It is
-- the top of the gate scripts' Redis Functions library (fleetgate.scripts.gate_library;
-- prepended to a script for EVAL by script_source), so the rules for time, limit, reaping and
-- hand-off are written once. A library's top level runs once, at load, so nothing here may
-- keep state across calls except through use_gate, which every call runs first.
--
-- KEYS[1] is the gate's base name, '<prefix>:{<gate>}' (fleetgate.keys.GateKeys.base); every key
-- of the gate is that base plus a fixed suffix (the same names as GateKeys, checked by
-- tests/lua/test_transitions.py::test_scripts_write_only_the_keys_gate_keys_names). One name
-- costs the client less to encode than ten (the "+ gate KEYS/ARGV" row of
-- benchmarks/uncontended.py);
-- every derived key shares the base's hash tag, so it lives in the slot the call is routed to.
-- On Cluster the client declares the data keys too (fleetgate._redis.RedisMode.script_keys).
-- The wake list of a pod is K_WAKE .. pod_id.
local K_CFG, K_TARGET, K_HOLDERS, K_QUEUE, K_WAITERS, K_SEQ, K_STATS, K_PODS, K_UTIL, K_WAKE
local K_LANES, K_FAIR, K_BIG, K_ADM, K_TW, K_EVICTED, K_OBS
local ADM, ADM_DIRTY, PHI, TAGS, FAIR  -- per-gate caches of one call (see lib_order.lua)
local SHARES  -- the band shares of the gate's configuration (load_cfg; lib_share.lua)
local K_BASE  -- the base the keys were derived from (a Functions library keeps it across calls)
local function use_gate(base)
  if base ~= K_BASE then  -- (the names are a function of the base: derived once per base)
    K_BASE = base
    K_CFG, K_TARGET, K_HOLDERS = base .. ':cfg', base .. ':target', base .. ':holders'
    K_QUEUE, K_WAITERS, K_SEQ = base .. ':queue', base .. ':waiters', base .. ':seq'
    K_STATS, K_PODS, K_UTIL = base .. ':stats', base .. ':pods', base .. ':util'
    K_WAKE = base .. ':wake:'
    K_LANES, K_FAIR, K_BIG = base .. ':lanes', base .. ':fair', base .. ':big'
    K_ADM, K_TW, K_EVICTED = base .. ':adm', base .. ':tw', base .. ':evicted'
    K_OBS = base .. ':obs'
  end
  ADM, ADM_DIRTY, PHI, TAGS, FAIR, SHARES = {}, {}, {}, {}, nil, nil
end
-- EVAL form only: gate_library drops the next line (each library function runs it first).
use_gate(KEYS[1])

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A number, or the default for nil, NaN, infinities (tonumber accepts 'inf' and '1e400') and
-- magnitudes beyond 2^53, where a lease would never expire or a floor would lift the cap.
local function num(v, default)
  local n = tonumber(v)
  if n == nil or n ~= n or n > 9007199254740992 or n < -9007199254740992 then return default end
  return n
end

-- n (never negative) as 20 digits, zero-padded: members sort by bytes as the numbers do.
local function pad20(n)
  return string.format('%020.0f', n)
end
