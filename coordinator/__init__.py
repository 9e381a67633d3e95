"""fleetgate coordinator: the leader-elected daemon that adapts and publishes gate targets.

The room, by job, top down (imports point down the list, never up):

* :mod:`.daemon` -- the :class:`~.daemon.Coordinator` process: lifecycle, election and poll
  loops (``fleetgate coordinator`` runs :func:`~.daemon.run_coordinator`);
* :mod:`.poll` -- one poll's I/O: scrape, read, publish; :mod:`.reaper` -- the sweeps and prunes;
* :mod:`.gates` -- each gate's controller, and its decision of a poll;
* :mod:`.gate_control` -- the two controllers behind one protocol;
* :mod:`.controller` (AIMD, on the server's gauges) and :mod:`.gradient` (latency, on what the
  callers report) -- the pure rules, their values in :mod:`.controller_types` and
  :mod:`.gradient_types`;
* :mod:`.publisher` -- the epoch-fenced writes; :mod:`.errorlog` -- how the loops log failures,
  :mod:`.reach` -- whether Redis answers, told while it does not;
* :mod:`.control` -- the protocol: what a controller takes and gives;
* :mod:`.election` -- the leader lease; :mod:`.observations` -- the client-observed counters;
  :mod:`.metrics` -- the daemon's own;
* :mod:`.config` -- the TOML configuration;
* :mod:`.scrape` -- reading the model servers' ``/metrics`` (a sub-room of its own).
"""
