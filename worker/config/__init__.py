"""The worker's TOML config, read once at the edge into frozen dataclasses."""

from worker.config.settings import *  # noqa: F403
from worker.config.settings import __all__ as __all__
