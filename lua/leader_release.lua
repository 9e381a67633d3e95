-- leader_release: give up leadership at once (clean shutdown), only if the caller owns it, so a
-- standby takes over without waiting for the TTL.
-- KEYS: 1 leader key
-- ARGV: 1 coordinator id
-- Returns 1 if released, 0 if it was not ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
