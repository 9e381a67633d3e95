-- leader_renew: extend the coordinator leadership lease, only if the caller still owns it.
-- KEYS: 1 leader key
-- ARGV: 1 coordinator id  2 ttl_ms
-- Returns 1 if renewed, 0 if the lease is gone or owned by another coordinator.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
