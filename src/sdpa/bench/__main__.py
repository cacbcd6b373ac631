"""``python -m sdpa.bench``: see :mod:`sdpa.bench.cli`."""

import sys

from .cli import main

sys.exit(main())
