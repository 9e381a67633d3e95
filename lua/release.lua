-- release: give leases back and hand the freed units to waiters in the same call. The client
-- sends releases here only when it has nothing to acquire on the gate (else they ride with
-- acquire.lua, which releases first); a batch holds what was released while its previous call
-- was in flight.
-- KEYS: 1 the gate's base name (see lib.lua)
-- ARGV: the lease ids
-- Returns the number of ids that held a lease: an id already gone (double release, or expired
--   and reaped) frees nothing of anyone else's.
-- With nobody waiting this is four commands: no clock, no configuration, no limit is needed
-- (the schema is checked: a newer gate is refused before anything changes).
check_schema(redis.call('HGET', K_CFG, 'schema'))
local released = remove_leases(ARGV, 1, #ARGV)
if released > 0 then redis.call('HINCRBY', K_STATS, 'released', released) end
if redis.call('ZCARD', K_WAITERS) > 0 then
  local now = now_ms()
  local cfg = load_cfg()
  handoff(now, cfg, current_limit(now, cfg))
end
adm_flush()
return released
