"""What a run's figures depend on, recorded in its report: the machine, the versions, the commit.

Figures from different runs only compare when these match, so every report carries them: the
command as typed, the start and end times, the cores and CPU model, Python, numpy, redis-py and
the Redis server's versions, and, from a git checkout, the commit measured and the producer or
worker files changed since.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import redis

__all__ = ["command_line", "gpus", "machine", "source", "utc_now"]


def utc_now() -> str:
    """The wall-clock time as ``YYYY-MM-DDTHH:MM:SSZ``, for the report's timestamps."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def command_line() -> str | None:
    """The command as typed, when this process is the ``redbatch`` command line."""
    if Path(sys.argv[0]).name in ("redbatch", "__main__.py"):
        return shlex.join(["redbatch", *sys.argv[1:]])
    return None


def source() -> dict[str, Any] | None:
    """The commit measured and the files changed since, when running from a git checkout."""
    root = Path(__file__).resolve().parents[2]  # this file is producer/bench/provenance.py
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "producer", "worker"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "changed": [line[3:] for line in status.splitlines()]}


def gpus() -> list[str]:
    """The NVIDIA GPUs as ``nvidia-smi`` lists them (name, driver, memory); none without it."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        listed = subprocess.run(
            ["nvidia-smi", *query], capture_output=True, text=True, timeout=15, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.splitlines() if line.strip()]


def machine(url: str) -> dict[str, Any]:
    """Cores, CPU, OS and versions: what the figures depend on."""
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    conn = redis.Redis.from_url(url, socket_timeout=10)
    try:
        redis_version = conn.info("server").get("redis_version")
    finally:
        conn.close()
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "redis_py": redis.__version__,
        "redis_server": redis_version,
        "gpus": gpus(),
    }
