"""Helpers for end-to-end tests: write a model and config, run a real worker, send raw requests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import redis
from eventually import eventually

from producer.protocol.codec import Reply, decode_reply, encode_request
from producer.protocol.keys import reply_key, request_stream
from tools.localredis import TlsFiles
from tools.synthetic import save
from worker.config import load_config
from worker.config.served import load_served
from worker.fleet.fleet import Fleet
from worker.fleet.watch import ConfigWatch
from worker.ops.metrics import Metrics
from worker.service import Prepared, Worker, prepare

PREFIX = "redbatch"


def write_config(
    tmp_path: Path,
    model: str,
    redis_url: str,
    *,
    name: str | None = None,
    extra: str = "",
    batching: str = "max_batch_size = 32\nmax_wait_ms = 20",
    model_extra: str = "",
) -> Path:
    """Build the named synthetic model and a config for it; returns the config path."""
    model_path = save(model, tmp_path / f"{model}.onnx")
    config = tmp_path / f"{name or model}.toml"
    config.write_text(
        f"""
[redis]
url = "{redis_url}"
prefix = "{PREFIX}"

[model]
name = "{name or model}"
path = "{model_path.name}"
version = "7"
providers = ["cpu"]
{model_extra}

[batching]
{batching}

[warmup]
runs = 1
{extra}
"""
    )
    return config


def serve_in_thread(
    worker: Worker, name: str = "w1"
) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``worker`` on a daemon thread; the list collects what stopped it, if anything."""
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            worker.run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=serve, name=f"worker-{name}", daemon=True)
    thread.start()
    return thread, failure


@contextlib.contextmanager
def running_worker(
    config_path: Path,
    name: str = "w1",
    metrics: Metrics | None = None,
    adjust: Callable[[Prepared], None] | None = None,
) -> Iterator[Worker]:
    """A real worker serving in a background thread; stopped (gracefully) on exit.
    ``adjust`` may change the prepared model before the worker is built."""
    config = load_config(config_path)
    prepared = prepare(config, name)
    if adjust is not None:
        adjust(prepared)
    client = redis.Redis.from_url(config.redis.url)
    worker = Worker(prepared, client, metrics=metrics)
    thread, failure = serve_in_thread(worker, name)
    ready_by = time.monotonic() + 60
    while not worker.ready.wait(0.05):
        assert thread.is_alive(), f"worker failed to start: {failure}"
        assert time.monotonic() < ready_by, "worker not ready within 60 s"
    try:
        yield worker
    finally:
        worker.request_stop()
        thread.join(timeout=30)
        client.close()
    assert not thread.is_alive(), "worker did not stop"
    assert not failure, failure


@contextlib.contextmanager
def running_fleet(
    config_path: Path,
    name: str = "w1",
    watch_s: float = 0.0,
    environ: Mapping[str, str] | None = None,
) -> Iterator[Fleet]:
    """A real worker process's models (``worker.fleet``), in a background thread, as the CLI
    runs them: every model of ``config_path`` prepared, served, stopped (gracefully) on exit.
    ``watch_s``: ``[worker] watch_config_s``; ``environ`` instead of os.environ (REDIS_URL)."""
    served = load_served(config_path, environ)
    watch = ConfigWatch(config_path, watch_s) if watch_s else None
    fleet = Fleet(served, name, read_config=lambda: load_served(config_path, environ), watch=watch)
    fleet.prepare()
    client = redis.Redis.from_url(served.models[0].redis.url)
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            fleet.run(client)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=serve, name=f"fleet-{name}", daemon=True)
    thread.start()
    # Several models, no one event: poll /readyz's answer (or the thread's end)
    eventually(lambda: fleet.ready() or not thread.is_alive(), 120, "every model ready")
    assert thread.is_alive(), f"worker failed to start: {failure}"
    try:
        yield fleet
    finally:
        fleet.request_stop()
        thread.join(timeout=60)
        fleet.close()
        client.close()
    assert not thread.is_alive(), "the worker did not stop"
    assert not failure, failure


def send(
    r: redis.Redis, model: str, rid: str, inputs: Mapping[str, Any] | None = None, **kw: Any
) -> str:
    """XADD one request built by the codec (or a raw ``body=`` bytes)."""
    body = kw.pop("body", None)
    if body is None:
        body = encode_request(inputs or {}, **kw)
    r.xadd(request_stream(PREFIX, model), {"rid": rid, "body": body})
    _SENT_TO[rid] = model
    return rid


# rid -> the model ``send`` sent it to: its reply key is in that model's slot (contract v2)
_SENT_TO: dict[str, str] = {}


def wait_reply(
    r: redis.Redis, rid: str, timeout_s: float = 20.0, model: str | None = None
) -> Reply:
    """Block on the reply list (BLPOP consumes it) and decode it; the model is the one ``send``
    sent ``rid`` to unless given."""
    tag = model or _SENT_TO.get(rid, "demo")
    got = r.blpop([reply_key(PREFIX, tag, rid)], timeout=timeout_s)
    assert got is not None, f"no reply for {rid} within {timeout_s}s"
    return decode_reply(got[1])


def direct_run(model_path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same model run by a bare ONNX Runtime session, for comparison."""
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds)), strict=True))


def stream_is_empty(r: redis.Redis, model: str) -> bool:
    """Nothing left: no entries in the stream and nothing pending in the group."""
    key = request_stream(PREFIX, model)
    groups = r.xinfo_groups(key)
    return r.xlen(key) == 0 and all(g["pending"] == 0 for g in groups)


def tls_files(where: Path) -> TlsFiles:
    """A certificate for 127.0.0.1 and localhost, its key, and the CA that signed it (made
    with trustme, for a TLS-only test server)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = TlsFiles(where / "server.pem", where / "server.key", where / "ca.pem")
    cert.cert_chain_pems[0].write_to_path(files.cert)
    cert.private_key_pem.write_to_path(files.key)
    ca.cert_pem.write_to_path(files.ca)
    return files


#: The docs/security.md marker before its aclfile block (the tests load that block verbatim).
ACL_MARKER = "<!-- aclfile: tests/test_security.py reads the next code block verbatim -->"
#: The administrator the security tests add to the doc's users, for their own checks.
ADMIN, ADMIN_PASSWORD = "test-admin", "test-admin-password"


def doc_aclfile() -> str:
    """The code block after the marker in docs/security.md, verbatim."""
    doc = Path(__file__).resolve().parents[1] / "docs" / "security.md"
    _, after = doc.read_text(encoding="utf-8").split(ACL_MARKER, 1)
    return after.split("```", 2)[1].strip("\n")
