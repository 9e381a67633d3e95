"""Stand-ins for what surrounds fleetgate in production, to run, test and show it on one machine.

Not part of the product (nothing in the core, the client or the coordinator imports them):

- :mod:`fleetgate.tools.sim`: model-server simulators (vLLM and its look-alikes, a NIM-like
  reranker) standing in for GPUs;
- :mod:`fleetgate.tools.redisproc`: a private ``redis-server`` (or Cluster) on a free port;
- :mod:`fleetgate.tools.load`: the load generator (``fleetgate worker``), standing in for the
  application pods that take permits.

Tests, benchmarks, the demo and docker-compose use them.
"""
