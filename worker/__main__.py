"""``python -m worker``: the same as ``redbatch-worker``."""

import sys

from worker.cli import main

sys.exit(main())
