"""``python -m fleetgate.cli``: the ``fleetgate`` command, as the console script runs it."""

import sys

from fleetgate.cli import main

sys.exit(main())
