"""A throwaway ``redis-server`` on a free loopback port, for the demo and the tests.

It is started with no persistence and its own temporary directory, and it is only ever stopped or
flushed by whoever started it.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

__all__ = ["LocalRedis", "RedisNotInstalled", "free_port"]

INSTALL_HINT = (
    "redis-server is not installed. Install it with 'sudo apt-get install redis-server' "
    "(Debian/Ubuntu), 'brew install redis' (macOS), or point REDIS_URL at a running Redis."
)


class RedisNotInstalled(RuntimeError):
    """Raised when no redis-server binary is on PATH."""


def free_port() -> int:
    """Ask the kernel for a free loopback port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRedis:
    """Start, stop and restart a private redis-server; use as a context manager."""

    def __init__(self, *extra_args: str, port: int | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisNotInstalled(INSTALL_HINT)
        self.port = port or free_port()
        self.extra_args = extra_args
        self._dir = tempfile.TemporaryDirectory(prefix="redbatch-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def dir(self) -> Path:
        return Path(self._dir.name)

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        """Start the server and return once it answers PING."""
        assert self.binary is not None
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.dir / "redis.log"),
            *self.extra_args,
        ]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._proc is not None and self._proc.poll() is not None:
                    err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                    raise RuntimeError(f"redis-server exited at start: {err.strip()}")
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {self.port}")
                time.sleep(0.02)  # polling a process that gives no readiness event
        finally:
            client.close()

    def stop(self, kill: bool = False) -> None:
        """Stop the server (SIGKILL when ``kill``) and wait for it to exit."""
        if self._proc is None:
            return
        if kill:
            self._proc.kill()
        else:
            self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stderr:
            self._proc.stderr.close()
        self._proc = None

    def restart(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
