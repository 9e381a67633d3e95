-- Shared library (lib_*.lua, see lib_gate.lua): the wake-ups a call sends to pods.

-- Wake-ups of one call, grouped by pod: one RPUSH (and PEXPIRE) per pod, not per id. Ids are
-- '<pod-id>:<n>[w<W>]'; the pod id is everything before the last colon. A wake is
-- '<id>=<token>' (granted, with its fencing token), '<id>=x' (evicted: Overloaded) or
-- '<id>=c<C>' (refused: heavier than the ceiling C now in force; ConfigError, see refuse_heads).
local function new_wakes()
  return {pods = {}, values = {}}
end

local function add_wake(wakes, id, value)
  local pod = string.match(id, '^(.*):[^:]*$')
  if pod then
    local values = wakes.values[pod]
    if values == nil then
      values = {}
      wakes.values[pod] = values
      wakes.pods[#wakes.pods + 1] = pod
    end
    values[#values + 1] = value
  end
end

-- A pod on Redis Cluster listens on the shard channel named like its wake list, one
-- SSUBSCRIBE connection per node (client/_node_wakes.py): SPUBLISH reaches it there, the ids of
-- one call in one message, separated by newlines (no id holds a control character). A wake
-- nobody heard -- a pod that pops lists (standalone, Sentinel), a pod between two
-- subscriptions (it pops the list once subscribed), a dead pod, a server or ACL that refuses
-- SPUBLISH (pcall) -- goes to the list, as ever. Wakes to several pods ask first who listens,
-- in one PUBSUB SHARDNUMSUB (a standalone server's answer is nobody: no SPUBLISH is sent), and
-- publish only to the pods that do; a refused PUBSUB leaves every pod to its SPUBLISH.
local function send_wakes(wakes, cfg)
  local pods = wakes.pods
  local subs, ttl = nil, string.format('%d', cfg.waiter_ms * 2)
  if #pods > 1 then
    local channels = {}
    for i, pod in ipairs(pods) do channels[i] = K_WAKE .. pod end
    local got = redis.pcall('PUBSUB', 'SHARDNUMSUB', unpack(channels))
    if type(got) == 'table' and got.err == nil and #got == 2 * #pods then subs = got end
  end
  for i, pod in ipairs(pods) do
    local key = K_WAKE .. pod
    local values = wakes.values[pod]
    local heard = 0
    if subs == nil or tonumber(subs[2 * i]) > 0 then
      heard = redis.pcall('SPUBLISH', key, table.concat(values, '\n'))
    end
    if type(heard) ~= 'number' or heard < 1 then
      redis.call('RPUSH', key, unpack(values))
      -- A dead pod's list disappears by itself; a live pod pops it long before this.
      redis.call('PEXPIRE', key, ttl)
    end
  end
end
