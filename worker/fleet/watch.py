"""Notice that the config file changed, for ``[worker] watch_config_s``.

Kubernetes updates a mounted ConfigMap in place (an atomic swap of the symlinks under the mount,
within about a minute of the change), and no signal reaches the worker; this compares the file's
bytes every ``interval_s`` instead, so a ConfigMap change rolls in without a pod restart.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

__all__ = ["ConfigWatch"]


class ConfigWatch:
    """``changed()`` is true once each time the file's bytes differ from the last seen."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self.path = path
        self.interval_s = interval_s
        self._seen = self._digest()
        self._next = time.monotonic() + interval_s

    def changed(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        digest = self._digest()
        if digest is None or digest == self._seen:
            return False  # gone for the moment (a swap under way): look again next time
        self._seen = digest
        return True

    def _digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None
