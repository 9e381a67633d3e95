"""``python -m fleetgate.demo`` (``make demo``): the same as ``fleetgate demo``."""

from fleetgate.demo.main import main

raise SystemExit(main())
