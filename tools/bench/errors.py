"""The bench's one error class, in a module of its own so every other bench module can raise it.

Load generation, scraping, process start-up and plotting all fail the same way for a caller
(the run cannot go on), and they sit at different levels of the package, so the class lives
below all of them rather than in any one. It descends from
``producer.protocol.errors.RedbatchError``,
so ``python -m tools.bench`` reports it like every other command's errors.
"""

from __future__ import annotations

from producer.protocol.errors import RedbatchError

__all__ = ["BenchError"]


class BenchError(RedbatchError):
    """Raised when a benchmark cannot run: a process it started failed, or did not answer."""
