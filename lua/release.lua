-- release: give leases back and hand the freed units to waiters in the same call. The client
-- sends releases here only when it has nothing to acquire on the gate (else they ride with
-- acquire.lua, which releases first); a batch holds what was released while its previous call
-- was in flight.
-- KEYS: 1 the gate's base name (see lib_gate.lua)
-- ARGV: 1 m, then m values: the released calls' reports as (field, increment) pairs for
--       fg:{G}:obs (fleetgate.observed.tally; m = 0 without reports), then the lease ids
-- Returns the number of ids that held a lease: an id already gone (double release, or expired
--   and reaped) frees nothing of anyone else's.
-- With nobody waiting this is three commands: no clock, no configuration, no limit is needed.
-- The schema is checked when there is someone to hand off to (load_cfg); a release alone is the
-- same in every schema (a future one that counts leases differently renames the key).
local m = tonumber(ARGV[1])
observe(ARGV, 2, 1 + m)
settle_tags(ARGV, 2, 1 + m)
local released = remove_leases(ARGV, 2 + m, #ARGV)
if released > 0 then redis.call('HINCRBY', K_STATS, 'released', released) end
if redis.call('ZCARD', K_WAITERS) > 0 then
  local now = now_ms()
  local cfg = load_cfg(now)
  -- what the hand-off reads of adm, in one HMGET: the counters, and the fields of the band its
  -- first turn serves (the fair order's top, read here and kept for it)
  local top = fair_top(2)
  local r = #top > 0 and string.sub(top[1], 1, 3) or '100'
  local got = redis.call('HMGET', K_ADM, 'extra', 'tok', 'rsv:' .. r, 'vt:' .. r, 'dr:' .. r)
  ADM['rsv:' .. r], ADM['vt:' .. r], ADM['dr:' .. r] = got[3], got[4], got[5]
  handoff(now, cfg, current_limit(now, cfg), units_held(got[1]), cfg.tlim and tokens_held(got[2]))
end
adm_flush()
return released
