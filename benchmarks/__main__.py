"""``python -m benchmarks [--quick] [--fast] [--only NAME ...]``: run all or some benchmarks."""

import sys

from benchmarks._common import main

if __name__ == "__main__":
    sys.exit(main())
