"""``python -m fleetgate.demo`` (``make demo``): the same as ``fleetgate demo``."""

from fleetgate.demo.main import main

if __name__ == "__main__":
    raise SystemExit(main())
