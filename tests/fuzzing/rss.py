"""Resident memory of a process, read from /proc, sampled through a fuzzing run."""

from __future__ import annotations

from typing import Any


def _vm_rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None  # a zombie has no VmRSS


class Rss:
    """Start, peak and end resident memory of one process, sampled as the run goes."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start_kb = self.peak_kb = self.end_kb = _vm_rss_kb(pid) or 0
        self.timeline_kb: list[int] = []  # one sample per tenth of the run: flat or a slope?

    def sample(self) -> bool:
        """Take a sample; False when the process is gone."""
        kb = _vm_rss_kb(self.pid)
        if kb is None:
            return False
        self.end_kb = kb
        self.peak_kb = max(self.peak_kb, kb)
        return True

    def summary(self) -> dict[str, Any]:
        mb = 1024.0
        return {
            "start": round(self.start_kb / mb, 1),
            "peak": round(self.peak_kb / mb, 1),
            "end": round(self.end_kb / mb, 1),
            "growth": round((self.end_kb - self.start_kb) / mb, 1),
            "by_tenth": [round(kb / mb, 1) for kb in self.timeline_kb],
        }
