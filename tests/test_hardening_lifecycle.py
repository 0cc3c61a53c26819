"""A refusing or misconfigured Redis, stop signals during outages, /healthz and worker names
(issue 26; contract section 4, v3)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.exceptions as rex
import trustme
from eventually import eventually
from harness import running_worker, send, tls_files, wait_reply, write_config

from producer import Client
from producer.protocol.errors import Misconfigured
from producer.protocol.keys import request_stream
from producer.redisio.retry import is_transient
from tools.localredis import LocalRedis, free_port
from worker import cli

ROOT = Path(__file__).resolve().parents[1]
MODEL = "demo"
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


# -- classification ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (rex.ResponseError("MISCONF Redis is configured to save RDB snapshots, but ..."), True),
        (rex.ReadOnlyError("You can't write against a read only replica."), True),
        (rex.ExecAbortError("Transaction discarded because of: MISCONF Redis is ..."), True),
        (rex.ConnectionError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"), False),
        (rex.ConnectionError("[SSL: WRONG_VERSION_NUMBER] wrong version number"), False),
        (rex.ConnectionError("Error 111 connecting to h:1. Connection refused."), True),
    ],
)
def test_only_what_will_pass_is_an_outage(exc: Exception, transient: bool) -> None:
    assert is_transient(exc) is transient


# -- MISCONF ------------------------------------------------------------------------------------


def _persistence(admin: redis.Redis, dump: Path, works: bool) -> None:
    """Break or mend RDB saving, and wait until Redis says so: a directory where the dump
    goes fails the save's final rename (whoever runs the tests, root included)."""
    if works:
        (dump / "dump.rdb").rmdir()
    else:
        (dump / "dump.rdb").mkdir()
    admin.bgsave()
    want = "ok" if works else "err"

    def saved() -> bool:
        info = admin.info("persistence")
        return not info["rdb_bgsave_in_progress"] and info["rdb_last_bgsave_status"] == want

    eventually(saved, what=f"BGSAVE status {want}")


def test_a_worker_rides_out_misconf_and_answers_once_redis_persists_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    dump = tmp_path / "dump"
    dump.mkdir()
    with LocalRedis("--save", "3600 1", "--dir", str(dump)) as server:
        admin = server.client()
        config = write_config(tmp_path, MODEL, server.url)
        running, proceed = threading.Event(), threading.Event()
        with running_worker(config, name="misconf") as worker:
            real_run = worker.model.run

            def held_run(feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
                running.set()
                assert proceed.wait(60)
                return real_run(feeds, names)

            monkeypatch.setattr(worker.model, "run", held_run)
            # Given a batch in hand when Redis can no longer persist (a full disk)
            send(admin, MODEL, "through-misconf", {"features": X})
            assert running.wait(30)
            _persistence(admin, dump, works=False)
            with pytest.raises(rex.ResponseError, match="MISCONF"):
                admin.set("probe", 1)
            proceed.set()
            # When the writer has met MISCONF for a while, the worker is still serving
            eventually(
                lambda: any("cannot persist" in r.getMessage() for r in caplog.records),
                what="the outage line",
            )
            assert not worker.stop.is_set()
            assert worker.writer.failure is None
            # Then, once Redis persists again, the batch is answered
            _persistence(admin, dump, works=True)
            reply = wait_reply(admin, "through-misconf", model=MODEL)
            assert reply.ok


# -- misconfigured connections ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalRedis, Path]]:
    """A TLS-only server, and the PEM of a CA that did not sign its certificate."""
    where = tmp_path_factory.mktemp("tls")
    files = tls_files(where)
    other = where / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(other)
    server = LocalRedis(tls=files)
    try:
        server.start()
    except RuntimeError as exc:
        server.close()
        pytest.skip(f"this redis-server has no TLS support: {exc}")
    yield server, other
    server.close()


@pytest.fixture(scope="module")
def plain() -> Iterator[LocalRedis]:
    with LocalRedis(password="right") as server:
        yield server


def _mistakes(tls: tuple[LocalRedis, Path], plain: LocalRedis) -> dict[str, tuple[str, str]]:
    """Each mistake: its URL, and the fix the error must name."""
    server, other_ca = tls
    return {
        "plain-to-tls": (f"redis://127.0.0.1:{server.port}/0", "use rediss://"),
        "tls-to-plain": (
            f"rediss://:right@127.0.0.1:{plain.port}/0?ssl_cert_reqs=none",
            "use redis://",
        ),
        "wrong-ca": (
            f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={other_ca}",
            "Pass the CA that signed it",
        ),
        "wrong-password": (plain.url_for(None, "wrong"), "password"),
    }


@pytest.mark.parametrize("mistake", ["plain-to-tls", "tls-to-plain", "wrong-ca", "wrong-password"])
def test_the_client_raises_misconfigured_at_once(
    tls: tuple[LocalRedis, Path], plain: LocalRedis, mistake: str
) -> None:
    url, fix = _mistakes(tls, plain)[mistake]
    started = time.monotonic()
    with Client(MODEL, url) as client, pytest.raises(Misconfigured) as info:
        client.backlog()
    assert time.monotonic() - started < 5
    assert fix in str(info.value)


def test_the_worker_exits_nonzero_at_once_naming_the_fix(
    tmp_path: Path, tls: tuple[LocalRedis, Path], plain: LocalRedis
) -> None:
    config = write_config(tmp_path, MODEL, "redis://127.0.0.1:1/0")
    started = time.monotonic()
    procs = {
        mistake: subprocess.Popen(
            [sys.executable, "-m", "worker", "--config", str(config), "--name", mistake],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "REDIS_URL": url},
        )
        for mistake, (url, _) in _mistakes(tls, plain).items()
    }
    for mistake, proc in procs.items():
        _, stderr = proc.communicate(timeout=60)
        fix = _mistakes(tls, plain)[mistake][1]
        assert proc.returncode == 2, (mistake, stderr)
        errors = [line for line in stderr.splitlines() if " ERROR " in line]
        assert len(errors) == 1, (mistake, stderr)
        assert fix in errors[0], (mistake, stderr)
    # Four workers load and warm up in parallel on a small box: well under 10 s each
    assert time.monotonic() - started < 30


# -- SIGTERM during an outage, and /healthz -----------------------------------------------------


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_worker_stuck_on_a_paused_redis_fails_healthz_and_exits_on_sigterm(
    tmp_path: Path,
) -> None:
    port = free_port()
    with LocalRedis() as server:
        admin = server.client()
        config = write_config(
            tmp_path,
            MODEL,
            server.url,
            batching="max_batch_size = 4\nmax_wait_ms = 1",
            extra=f"[delivery]\nclaim_idle_ms = 1000\n[metrics]\nport = {port}\nhost = "
            '"127.0.0.1"\n',
        )
        stream = request_stream("redbatch", MODEL)
        pipe = admin.pipeline(transaction=False)
        for i in range(3000):
            send(pipe, MODEL, f"r{i}", {"features": X})
        pipe.execute()
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "--config", str(config), "--name", "paused"],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert server._proc is not None
        redis_pid = server._proc.pid
        try:
            # Given a worker in the middle of a backlog when Redis is paused under it
            eventually(lambda: _pending(admin, stream) > 0, timeout_s=60, what="a batch held")
            os.kill(redis_pid, signal.SIGSTOP)
            # Then /healthz fails past claim_idle_ms and says why
            eventually(lambda: _get(port, "/healthz")[0] == 503, timeout_s=10, what="503")
            body = _get(port, "/healthz")[1]
            assert "no progress" in body, body
            assert "claim_idle_ms 1000" in body, body
            # And SIGTERM ends it within seconds, with a line saying what it left pending
            stopped = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=30)
            print(f"\nFIGURE sigterm_exit_s={time.monotonic() - stopped:.1f}")
            assert time.monotonic() - stopped < 12, stderr  # 3 s of grace, then 1 s at most
            assert proc.returncode == 0, stderr
            assert "stay pending" in stderr
        finally:
            os.kill(redis_pid, signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _pending(admin: redis.Redis, stream: str) -> int:
    try:
        return int(admin.xpending(stream, "workers")["pending"])
    except rex.ResponseError:  # no group yet
        return 0


# -- names --------------------------------------------------------------------------------------


def test_a_second_worker_under_a_live_workers_name_refuses_to_start(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    config = write_config(tmp_path, MODEL, redis_url)
    with running_worker(config, name="twin"):
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "worker", "--config", str(config), "--name", "twin"],
            cwd=ROOT,
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1, proc.stderr
        assert "another live worker holds the name 'twin'" in proc.stderr
        assert "--name" in proc.stderr
        assert time.monotonic() - started < 30
        # The first one keeps serving, its record in place
        send(rconn, MODEL, "after-twin", {"features": X})
        assert wait_reply(rconn, "after-twin", model=MODEL).ok
        eventually(lambda: rconn.exists("redbatch:{demo}:worker:twin"), what="the record")


def test_a_stopped_workers_record_does_not_keep_its_name(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    # Given the record a crashed worker left, not yet expired
    rconn.set("redbatch:{demo}:worker:phoenix", "{}", ex=15)
    config = write_config(tmp_path, MODEL, redis_url)
    # Then a worker restarted under its name takes it over
    with running_worker(config, name="phoenix"):
        send(rconn, MODEL, "after-phoenix", {"features": X})
        assert wait_reply(rconn, "after-phoenix", model=MODEL).ok


def test_default_names_differ_on_one_host_name_and_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli.socket, "gethostname", lambda: "node-a")
    monkeypatch.setattr(cli.os, "getpid", lambda: 1)
    first, second = cli._default_name(), cli._default_name()
    assert first != second
    assert first.startswith("node-a-1-")
