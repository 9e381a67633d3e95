"""``fleetgate demo``: a whole fleet on one machine, for about a minute.

``python -m fleetgate.demo [--duration 60] [--out DIR] [--quiet]`` starts, as child processes:

* a private ``redis-server`` on a free port (or uses ``$FLEETGATE_REDIS_URL`` under a fresh,
  unique key prefix, deleting only that prefix's keys at the end);
* two vLLM simulators (a chat model with capacity 48 and a KV cache of 32,768 tokens, an
  embedder with capacity 96) and a reranker simulator (concurrency 32);
* two coordinators (``coord-a`` leads, ``coord-b`` stands by) from a generated TOML config:
  two adaptive gates (floor 4) on the vLLM simulators' ``/metrics``, one fixed rerank gate (32);
  the chat gate also has a token budget, configured at a quarter of the cache (``token_limit``,
  ``token_ceiling`` twice the cache) and tuned by the coordinator to fill the cache the server
  states with what the calls use;
* three worker pods that push more load through the gates than the servers hold (the chat
  calls charge their prompt and ``max_tokens`` to the token budget and report their ``usage``);
* a search pod (:mod:`fleetgate.demo.interactive`) on the rerank gate: 4 interactive calls/s at
  priority 10 beside a batch backlog at priority 0 that grows all run long.

It then shows a live view every second (leader, epoch, per gate limit/target/in-flight/queue/
saturation/reason and the servers' running/waiting), SIGKILLs the leader halfway so the failover
is visible, halves the chat server's capacity at two thirds so the target follows it down, and
writes ``demo.png`` and ``demo.json`` to the output directory (default ``demo-out/``); under
the chat gate's panel the plot has its token panel (the budget in force, the tokens held, the
KV cache the server uses and states) and the summary says where the budget converged and when;
the plot's last panel shows the interactive calls' wait staying flat while the batch queue grows.

Every child runs in its own process group and is stopped in order (workers, coordinators,
simulators, Redis): SIGTERM, a bounded wait, SIGKILL for stragglers — at the end, on Ctrl-C or
SIGTERM, and when the demo itself fails. On Linux the children also get SIGTERM if the demo dies.
"""

from __future__ import annotations

from fleetgate.demo.main import build_parser, main

__all__ = ["build_parser", "main"]
