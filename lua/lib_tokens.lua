-- Shared library (lib_*.lua, see lib_gate.lua): fencing tokens and waiters' seqs.

-- The first of k new fencing tokens, k >= 1: the call's tokens are first .. first + k - 1.
-- Never below server time x 1000: a token issued at server time t lies in [t x 1000, the
-- counter], and the counter runs ahead of the clock only while the gate grants more than 1000
-- per millisecond. So tokens stay above every token the gate ever issued when the counter is
-- lost (a restart: it starts again at the clock) or rolled back (a failover to a replica that
-- missed the last grants: the clock is past them), unless the new server's clock is behind the
-- old one's by more than the time between (tests/lua/test_fencing_tokens.py). Holders also raise it
-- above their own tokens (raise_seq). A parked caller's seq (its place in its lane) comes from
-- the same counter, so later arrivals never sort before it; its fencing token is a fresh one
-- taken when it is granted.
local SEQ_PER_MS = 1000
local function next_tokens(now, k)
  local t = redis.call('INCRBY', K_SEQ, k)
  local least = now * SEQ_PER_MS + k - 1
  if t < least then
    t = least
    redis.call('SET', K_SEQ, string.format('%d', t))  -- (an integer: now x 1000 + k - 1)
  end
  return t - k + 1
end

local function raise_seq(token)
  if token and token > 0 then
    local s = num(redis.call('GET', K_SEQ), 0)
    if s < token then redis.call('SET', K_SEQ, string.format('%.0f', token)) end
  end
end
