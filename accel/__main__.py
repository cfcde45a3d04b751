"""``python -m accel``: the command-line interface (see ``accel._cli``)."""

from __future__ import annotations

import sys

from accel._cli import main

if __name__ == "__main__":
    sys.exit(main())
