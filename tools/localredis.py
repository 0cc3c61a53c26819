"""A throwaway ``redis-server`` on a free loopback port, for the demo and the tests.

It is started with no persistence and its own temporary directory, and it is only ever stopped or
flushed by whoever started it. It can also be locked down the way production Redis should be
(``docs/security.md``): a password (``requirepass``), ACL users from an aclfile, and TLS on its
only port, so tests can show that the worker and the clients work, and fail, as they would there.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis

__all__ = ["LocalRedis", "PortTaken", "RedisNotInstalled", "TlsFiles", "free_port"]

INSTALL_HINT = (
    "redis-server is not installed. Install it with 'sudo apt-get install redis-server' "
    "(Debian/Ubuntu), 'brew install redis' (macOS), or point REDIS_URL at a running Redis."
)


class RedisNotInstalled(RuntimeError):
    """Raised when no redis-server binary is on PATH."""


class PortTaken(RuntimeError):
    """Raised when redis-server could not listen on its port: another process holds it."""


_PORT_DRAWS = 5


def free_port() -> int:
    """Ask the kernel for a free loopback port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for a TLS-only server: its certificate chain, its key, and the CA clients trust."""

    cert: Path
    key: Path
    ca: Path


class LocalRedis:
    """Start, stop and restart a private redis-server; use as a context manager.

    ``password`` alone becomes ``requirepass`` (the ``default`` user's password). With ``acl``
    (aclfile text, one ``user`` line each), ``username`` and ``password`` are instead the
    credentials of a user in it that this class uses itself: for the readiness check and in
    ``url``. With ``tls`` the server listens only on a TLS port (``port`` is that port) and
    does not ask clients for certificates; ``extra_args`` come last, so they can override that.
    """

    def __init__(
        self,
        *extra_args: str,
        port: int | None = None,
        password: str | None = None,
        username: str | None = None,
        acl: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisNotInstalled(INSTALL_HINT)
        if username is not None and acl is None:
            raise ValueError("username needs acl: without an aclfile only 'default' exists")
        self.port = port or free_port()
        self._own_port = port is None  # drawn here: another may be drawn if it is taken
        self.extra_args = extra_args
        self.username = username
        self.password = password
        self.acl = acl
        self.tls = tls
        self._dir = tempfile.TemporaryDirectory(prefix="redbatch-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL this class itself connects with (its own credentials, TLS when on)."""
        return self.url_for(self.username, self.password)

    def url_for(self, username: str | None, password: str | None) -> str:
        """A URL for this server as ``username`` (None: ``default``) with ``password``.

        For TLS it is ``rediss://`` with ``ssl_ca_certs`` naming the test CA, a query
        parameter redis-py reads.
        """
        auth = ""
        if password is not None:
            auth = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        ca = quote(str(self.tls.ca), safe="/")
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={ca}"

    @property
    def dir(self) -> Path:
        return Path(self._dir.name)

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        """Start the server and return once it answers PING. A port drawn here that another
        process took between the draw and the start (test modules run in parallel) is drawn
        again, a few times."""
        for attempt in range(_PORT_DRAWS):
            try:
                return self._start(timeout_s)
            except PortTaken:
                if not self._own_port or attempt == _PORT_DRAWS - 1:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> LocalRedis:
        assert self.binary is not None
        args = [
            self.binary,
            *self._listen_args(),
            *self._auth_args(),
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

    def _listen_args(self) -> list[str]:
        """Plain TCP on ``port``, or TLS alone on it (``--port 0`` closes the plain port)."""
        if self.tls is None:
            return ["--port", str(self.port)]
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.tls.cert),
            "--tls-key-file",
            str(self.tls.key),
            "--tls-ca-cert-file",
            str(self.tls.ca),
            "--tls-auth-clients",
            "no",
        ]

    def _auth_args(self) -> list[str]:
        """An aclfile written to the server's directory, or requirepass, or nothing."""
        if self.acl is not None:
            aclfile = self.dir / "users.acl"
            aclfile.write_text(self.acl.strip() + "\n", encoding="utf-8")
            return ["--aclfile", str(aclfile)]
        if self.password is not None:
            return ["--requirepass", self.password]
        return []

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._proc is not None and self._proc.poll() is not None:
                    err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                    log = self._log_tail()
                    kind = PortTaken if "already in use" in f"{err} {log}" else RuntimeError
                    raise kind(f"redis-server exited at start: {err.strip()} {log}")
                if self._answers(client):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {self.port}")
                time.sleep(0.02)  # polling a process that gives no readiness event
        finally:
            client.close()

    def _answers(self, client: redis.Redis) -> bool:
        """True once PING succeeds and the server answering is this class's own process (not
        another that holds the port); wrong credentials are not worth waiting for."""
        try:
            return bool(client.ping()) and self._is_ours(client)
        except redis.AuthenticationError as exc:
            raise RuntimeError(
                f"redis-server on port {self.port} refused this class's own credentials: {exc}"
            ) from exc
        except redis.ConnectionError:
            return False

    def _is_ours(self, client: redis.Redis) -> bool:
        if self._proc is None:
            return True
        try:
            pid = client.info("server").get("process_id")
        except redis.exceptions.NoPermissionError:
            return True  # a user without INFO: PING had to do
        return pid == self._proc.pid

    def _log_tail(self, lines: int = 5) -> str:
        """The last lines of the server log: where a bad aclfile or TLS file is explained."""
        with contextlib.suppress(OSError):
            text = (self.dir / "redis.log").read_text(encoding="utf-8", errors="replace")
            return " | ".join(text.strip().splitlines()[-lines:])
        return ""

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client connected as this class connects (its credentials, its TLS)."""
        return redis.Redis.from_url(self.url, **kwargs)

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
