-- publish: everything the coordinator writes of one gate per poll, fenced by the leader's epoch in
-- one call: the gate configuration, the utilisation snapshot (with the controller state a new
-- leader resumes from), and optionally a new target; then any new room is handed to the head
-- waiters at once (a target increase or a raised floor); a lowered ceiling refuses the waiters
-- heavier than it (lib_handoff.lua refuse_heads: ConfigError, as an arrival that heavy gets).
-- KEYS: 1 the gate's base name (see lib_gate.lua)
-- ARGV: 1 epoch  2 ttl_ms (of the target)  3 target value, or '' to leave the target alone
--       4 n = number of cfg fields, then n (field, value) pairs for fg:{G}:cfg (the pair
--       'tenant_weights', 'name}w}...' replaces fg:{G}:tw instead; the pair 'token_target', T
--       publishes the tuned token budget T for ttl_ms, as the target is (its lapse time
--       beside it: 'token_target_until'; '' withdraws it); a value '' deletes the field;
--       'schema' is never written),
--       then (field, value) pairs for fg:{G}:util (the rest of ARGV)
-- Returns {accepted, limit, stored_epoch, granted}: accepted = 0 when epoch < the epoch stored in
--   the target (a deposed leader waking up writes nothing: not the target, not the cfg, not the
--   snapshot). An accepted call stores its epoch in the target even without a target value, so a
--   fixed gate (never a target) is fenced too.
local epoch, ttl, value = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local now = now_ms()
local stored = num(redis.call('HGET', K_TARGET, 'epoch'), nil)
if stored and epoch < stored then
  return {0, current_limit(now, load_cfg(now)), stored, 0}
end
local n_cfg = tonumber(ARGV[4])
local cfg_pairs, util_pairs = {}, {}
check_schema(redis.call('HGET', K_CFG, 'schema'))
for i = 5, 4 + 2 * n_cfg, 2 do
  if ARGV[i] == 'tenant_weights' then
    store_tenant_weights(ARGV[i + 1])  -- replaced whole: fg:{G}:tw
  elseif ARGV[i] == 'token_target' then  -- the second target: it lapses as the first does
    if ARGV[i + 1] == '' then
      redis.call('HDEL', K_CFG, 'token_target', 'token_target_until')
    else
      cfg_pairs[#cfg_pairs + 1] = 'token_target'
      cfg_pairs[#cfg_pairs + 1] = math.floor(num(ARGV[i + 1], 0))
      cfg_pairs[#cfg_pairs + 1] = 'token_target_until'
      cfg_pairs[#cfg_pairs + 1] = now + ttl
    end
  elseif ARGV[i + 1] == '' then
    redis.call('HDEL', K_CFG, ARGV[i])  -- unset in the configuration: the default applies
  elseif ARGV[i] ~= 'schema' then
    cfg_pairs[#cfg_pairs + 1] = ARGV[i]
    cfg_pairs[#cfg_pairs + 1] = ARGV[i + 1]
  end
end
for i = 5 + 2 * n_cfg, #ARGV do util_pairs[#util_pairs + 1] = ARGV[i] end
if #cfg_pairs > 0 then redis.call('HSET', K_CFG, unpack(cfg_pairs)) end
if #util_pairs > 0 then
  redis.call('HSET', K_UTIL, unpack(util_pairs))
  -- A gate the leader publishes is in use: no pruning clock (prune.lua) runs for it.
  redis.call('HDEL', K_UTIL, 'idle_since', 'idle_mark')
end
if value ~= '' then
  redis.call('HSET', K_TARGET, 'value', tonumber(value), 'epoch', epoch, 'expires_at', now + ttl)
else
  redis.call('HSET', K_TARGET, 'epoch', epoch)
end
local lim, granted = settle(now, load_cfg(now))
return {1, lim, epoch, granted}
