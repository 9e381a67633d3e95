-- heartbeat_many: the heartbeats of several gates of one pod in one call, so a pod's background
-- load is a few calls per heartbeat period, not one per gate. Each gate's part is exactly
-- heartbeat.lua's transition on that gate's own keys (heartbeat_gate), in turn: server time read
-- per gate, bounded reaping per gate. The gates' keys must share one node and
-- one slot (the client groups them: every gate on a standalone Redis or Sentinel master; on
-- Cluster only gates whose hash tags share a slot) and the client caps the gates per call, so
-- one call stays short.
-- KEYS: the gates' base names (see lib_gate.lua), gate j's at KEYS[j] for j = 1..n_gates; on
-- Cluster every gate's declared keys follow them (read by Redis for routing, never by this script)
-- ARGV: 1 n_gates, then per gate: argc, then argc values = heartbeat.lua's ARGV for that gate
-- Returns {reply of gate 1, ..., reply of gate n}, each heartbeat.lua's reply
local n = tonumber(ARGV[1])
local out = {}
local a = 2
for j = 1, n do
  use_gate(KEYS[j])
  local argc = tonumber(ARGV[a])
  local A = {}
  for k = 1, argc do A[k] = ARGV[a + k] end
  a = a + 1 + argc
  out[j] = heartbeat_gate(A)
end
return out
