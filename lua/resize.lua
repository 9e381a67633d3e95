-- resize: change the tokens a running lease holds, in one transition. Its id says its tokens
-- ('...t<T>', lib_order.lua), so a resized lease gets a new id: the old one leaves the holders,
-- the new one takes its expiry, and the old one is remembered in fg:{G}:evicted as '<old>=r'
-- for 2 x lease_ms, so a heartbeat already on its way with the old id neither renews nor counts
-- it again (heartbeat_lib.lua renew_lease); a lease resized back to an id it had loses that
-- id's tombstone.
-- Shrinking frees the tokens at once: they go to the waiters in this call. Growing takes only
-- tokens nobody waits for: it fits the token budget, no eligible waiter is parked (every free
-- token is owed to the head of the wait list), and the gate is not behind its recovery fence;
-- a growth that does not fit changes nothing (no partial growth) and never parks.
-- KEYS: 1 the gate's base name (see lib_gate.lua)
-- ARGV: 1 lease id  2 tokens it should hold (>= 0)
-- Returns {status, id, tokens}: status ST.RESIZED (1) = resized (id: the lease's id from now on;
--   tokens: what it holds), ST.RESIZE_REFUSED (0) = growth refused (does not fit now; id and
--   tokens unchanged), ST.RESIZE_LOST (-1) = no such lease (released, expired or lost),
--   ST.RESIZE_TOO_MANY (-2) = refused: more tokens than the token ceiling (tokens = the token
--   ceiling; ConfigError, as acquire's ST.TOO_MANY_TOKENS).
local id, want = ARGV[1], math.floor(num(ARGV[2], -1))
if want < 0 then error('fleetgate: resize wants tokens >= 0, got ' .. tostring(ARGV[2])) end
local now = now_ms()
local expiry = tonumber(redis.call('ZSCORE', K_HOLDERS, id))
if expiry == nil or expiry <= now then return {ST.RESIZE_LOST, id, 0} end
local cfg = load_cfg(now)
local have = tokens_asked(id)
if want == have then return {ST.RESIZED, id, have} end
if cfg.token_ceiling and want > cfg.token_ceiling then
  return {ST.RESIZE_TOO_MANY, id, cfg.token_ceiling}
end
local new_id = string.gsub(id, 't%d+$', '')
if want > 0 then new_id = new_id .. 't' .. string.format('%.0f', want) end
local tombstone = {now + 2 * cfg.lease_ms, id .. '=r'}
-- a lease resized back to a size it had holds an id that is tombstoned: it is live again
redis.call('ZREM', K_EVICTED, new_id .. '=r')
if want > have then
  local fits = cfg.fence <= now
    and (cfg.tlim == nil or tokens_held() + want - have <= cfg.tlim)
    and #redis.call('ZRANGEBYLEX', K_FAIR, '-', '+', 'LIMIT', 0, 1) == 0
  if not fits then return {ST.RESIZE_REFUSED, id, have} end
  -- counted before the new id is added, the old one removed after: an abort overcounts
  redis.call('HINCRBY', K_ADM, 'tok', want - have)
  redis.call('ZADD', K_HOLDERS, expiry, new_id)
  redis.call('ZREM', K_HOLDERS, id)
  redis.call('ZADD', K_EVICTED, unpack(tombstone))
else
  redis.call('ZADD', K_HOLDERS, expiry, new_id)
  redis.call('ZREM', K_HOLDERS, id)
  redis.call('ZADD', K_EVICTED, unpack(tombstone))
  lower_adm('tok', have - want)
  if redis.call('ZCARD', K_WAITERS) > 0 then handoff(now, cfg, current_limit(now, cfg)) end
end
redis.call('HINCRBY', K_STATS, STAT.RESIZED, 1)
adm_flush()
return {ST.RESIZED, new_id, want}
