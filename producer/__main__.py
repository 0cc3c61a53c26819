"""``python -m producer``: the ``redbatch`` command line."""

from __future__ import annotations

import sys

from producer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
