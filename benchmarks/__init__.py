"""fleetgate client benchmarks: ``python -m benchmarks [--quick] [--fast] [--only NAME ...]``.

Each benchmark starts its own private ``redis-server`` (never the machine's Redis) and writes
``benchmarks/results/<name>[-<flavor>][-quick].json`` and ``.png``. See benchmarks/README.md.
"""

from benchmarks._common import BENCHMARKS, Flavor, Headline, Options

__all__ = ["BENCHMARKS", "Flavor", "Headline", "Options"]
