"""Tools run from a checkout, never installed: the load test (``python -m tools.bench``), the
demo (``python -m tools.demo``), the synthetic model builders and the throwaway redis-server that
the tests, the demo and the bench start. ``pip install redbatch`` ships ``producer`` and
``worker`` only (``tests/test_packaging.py`` checks the wheel).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ROOT", "child_env"]

#: The checkout these tools run from.
ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that runs ``python -m tools....``: this one's, with
    the checkout first on ``PYTHONPATH`` (a child started elsewhere would not find ``tools``)."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"
    return env
