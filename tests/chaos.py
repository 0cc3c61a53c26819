"""Fault injection, black box: real worker processes, a real Redis, a model built here, an oracle.

The fast tier (``tests/test_faults.py``) and the full tier (``scripts/reliability.py``) run the
same scenario functions at different sizes. Each scenario starts its own ``redis-server`` and
worker subprocesses (``python -m worker``), drives load and faults, then asks the oracle:

- every request has exactly one reply (the reply list has length 1: a second ``RPUSH`` would
  show as 2), equal to its expected output or its expected error code;
- the stream is empty, nothing is pending, the dead-letter stream holds exactly the injected
  poison, and the consumer list is bounded by the live workers;
- duplicate executions are counted from ``REDBATCH_EXEC_LOG`` (``worker/faults.py``): at-least-
  once allows them after a kill, and the report shows how many.

The model (``y = tanh(x @ W + b)``, ``[N, 8] -> [N, 4]``, optionally with a fixed-cost side
chain that adds exactly zero) is built here with ``onnx.helper``; it is not in the repository
and the worker knows nothing about it. Expected outputs come from a direct onnxruntime run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import redis
from onnx import TensorProto, helper, numpy_helper
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer.codec import WireFormatError, decode_reply, encode_request
from producer.keys import CONSUMER_GROUP, dead_key, reply_key, request_stream, worker_key
from worker.localredis import LocalRedis

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "redbatch"
MODEL = "chaos"
CRASH_VALUE = 31337.0  # a float no healthy request holds: the crash pill's marker
POINTS = ("after_read", "after_inference", "before_finish", "after_finish")
STREAM = request_stream(PREFIX, MODEL)
DEAD = dead_key(PREFIX, MODEL)


class ScenarioTimeout(RuntimeError):
    """Raised when a condition a scenario waits for does not hold before its deadline."""


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Poll ``cond`` until true; for state that only Redis or /proc can tell, with no event."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise ScenarioTimeout(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------------
# The model


def build_model(path: Path, *, work_width: int = 0, work_depth: int = 0, seed: int = 11) -> Path:
    """Write ``y = tanh(x @ W + b)``; ``work_depth`` > 0 adds a fixed-cost chain of
    ``work_width``-square MatMul+Tanh layers whose result is multiplied by zero and added, so
    the run is slow but ``y`` is exactly the fast model's."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((8, 4)) * 0.5).astype(np.float32)
    b = (rng.standard_normal(4) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")]
    nodes = [
        helper.make_node("Gemm", ["x", "W", "b"], ["g"]),
        helper.make_node("Tanh", ["g"], ["t"]),
    ]
    if work_depth:
        m = (rng.standard_normal((work_width, work_width)) / np.sqrt(work_width)).astype(np.float32)
        inits += [
            numpy_helper.from_array(m, "M"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
        ]
        # The chain depends on x (times zero), so onnxruntime cannot fold it into a constant.
        nodes += [
            helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
            helper.make_node("Mul", ["s", "zero"], ["s0"]),
            helper.make_node("Add", ["M", "s0"], ["h0"]),
        ]
        for i in range(work_depth):
            nodes += [
                helper.make_node("MatMul", [f"h{i}", "M"], [f"m{i}"]),
                helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]),
            ]
        nodes += [
            helper.make_node("ReduceSum", [f"h{work_depth}"], ["hs"], keepdims=0),
            helper.make_node("Mul", ["hs", "zero"], ["hz"]),
            helper.make_node("Add", ["t", "hz"], ["y"]),
        ]
    else:
        nodes.append(helper.make_node("Identity", ["t"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "chaos",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())
    return path


def slow_depth(batch_ms: float, width: int = 1024) -> int:
    """Side-chain depth for a run of about ``batch_ms`` on this machine (one thread), measured
    here, so "slower than claim_idle_ms" holds on a fast CI machine too."""
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "probe.onnx", work_width=width, work_depth=4)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        feed = {"x": np.zeros((32, 8), np.float32)}
        session.run(None, feed)
        t0 = time.perf_counter()
        for _ in range(3):
            session.run(None, feed)
        per_layer_ms = (time.perf_counter() - t0) * 1000 / 12
    return max(4, min(400, math.ceil(batch_ms / per_layer_ms)))


@dataclass(frozen=True, slots=True)
class Expected:
    """What one request must be answered with: outputs ``y`` or an error code."""

    y: np.ndarray | None = None
    code: str | None = None


class Requests:
    """Request bodies by rid and what each must be answered with (a seeded mix of good and bad)."""

    def __init__(self, reference_model: Path, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.bodies: dict[str, bytes] = {}
        self.expected: dict[str, Expected] = {}
        self.malformed = 0
        self._session = ort.InferenceSession(
            str(reference_model), providers=["CPUExecutionProvider"]
        )

    def make(self, n: int, tag: str, *, bad_fraction: float = 0.0) -> list[str]:
        """``n`` new requests of 1 to 3 rows; ``bad_fraction`` of them are malformed or invalid."""
        rids = [f"{tag}-{len(self.bodies) + i}" for i in range(n)]
        good: list[tuple[str, np.ndarray]] = []
        for rid in rids:
            if self.rng.random() < bad_fraction:
                self.bodies[rid], code = self._bad()
                self.expected[rid] = Expected(code=code)
                self.malformed += 1
                continue
            x = self.rng.standard_normal((int(self.rng.integers(1, 4)), 8)).astype(np.float32)
            self.bodies[rid] = encode_request({"x": x})
            good.append((rid, x))
        if good:
            ys = self._session.run(["y"], {"x": np.concatenate([x for _, x in good])})[0]
            start = 0
            for rid, x in good:
                self.expected[rid] = Expected(y=ys[start : start + len(x)])
                start += len(x)
        return rids

    def _bad(self) -> tuple[bytes, str]:
        kind = int(self.rng.integers(0, 4))
        if kind == 0:
            return b"\xc1not msgpack", "MALFORMED"
        if kind == 1:
            return encode_request({"x": np.zeros((1, 8), np.float64)}), "INVALID_INPUT"
        if kind == 2:
            return encode_request({"x": np.zeros((1, 7), np.float32)}), "INVALID_INPUT"
        return encode_request({"x": np.full((1, 8), np.nan, np.float32)}), "INVALID_INPUT"

    def pill(self, tag: str) -> str:
        """A crash pill: its worker dies inside inference, every time it is run."""
        rid = f"{tag}-pill-{len(self.bodies)}"
        x = self.rng.standard_normal((1, 8)).astype(np.float32)
        x[0, 3] = CRASH_VALUE
        self.bodies[rid] = encode_request({"x": x})
        self.expected[rid] = Expected(code="POISONED")
        return rid


# ---------------------------------------------------------------------------------------------
# Workers


@dataclass(frozen=True, slots=True)
class Settings:
    """One scenario's worker config and model cost."""

    claim_idle_ms: int = 1000
    max_deliveries: int = 3
    max_batch_size: int = 32
    max_wait_ms: int = 5
    work_width: int = 256
    work_depth: int = 0


def write_config(workdir: Path, redis_url: str, model: Path, s: Settings) -> Path:
    """A worker config for the chaos model, one intra-op thread: several workers share 2 cores."""
    path = workdir / "worker.toml"
    path.write_text(
        f"""[redis]
url = "{redis_url}"
prefix = "{PREFIX}"

[model]
name = "{MODEL}"
path = "{model.name}"
version = "1"
providers = ["cpu"]
intra_op_threads = 1

[batching]
max_batch_size = {s.max_batch_size}
max_wait_ms = {s.max_wait_ms}

[delivery]
claim_idle_ms = {s.claim_idle_ms}
max_deliveries = {s.max_deliveries}
reply_ttl_s = 3600

[warmup]
runs = 1
"""
    )
    return path


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class WorkerProcess:
    """One ``python -m worker`` subprocess, its log file and its peak RSS (VmHWM, sampled)."""

    def __init__(self, config: Path, name: str, logdir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.faults = env.get("REDBATCH_FAULTS", "")
        self.log_path = logdir / f"{name}.{time.monotonic_ns()}.log"
        self.expected_exit = False  # set before a deliberate SIGKILL or SIGTERM
        self.peak_rss_kb = 0
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker", "--config", str(config), "--name", name],
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def sample_rss(self) -> None:
        self.peak_rss_kb = max(self.peak_rss_kb, _status_kb(self.pid, "VmHWM"))

    def is_ready(self, r: redis.Redis) -> bool:
        """Registered and warm: its record in Redis names this process."""
        raw = r.get(worker_key(PREFIX, MODEL, self.name))
        if not raw:
            return False
        record = json.loads(raw)
        return bool(record.get("pid") == self.pid and record.get("state") == "ready")

    def kill(self) -> None:
        self.sample_rss()
        self.expected_exit = True
        self.proc.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.sample_rss()
        self.expected_exit = True
        self.proc.send_signal(signal.SIGTERM)

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


Restart = Callable[["WorkerProcess"], "tuple[str, str] | None"]


class Pool:
    """Workers kept running like an orchestrator would: one that dies is restarted.

    ``restart`` decides, for a dead worker, the (name, REDBATCH_FAULTS) of its replacement, or
    None to leave it dead. Exits are seen by one waiting thread per process, not by polling.
    """

    def __init__(self, run: Run, restart: Restart | None = None) -> None:
        self.run = run
        self.restart = restart or (lambda w: (w.name, ""))
        self.workers: list[WorkerProcess] = []
        self.exits: list[tuple[str, int, bool]] = []  # (name, returncode, expected)
        self.restarts = 0
        self.peak_rss_kb = 0
        self._lock = threading.Lock()
        self._closing = False
        self._changed = threading.Condition(self._lock)
        self._sampler = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._sampler.start()

    def start(self, name: str, faults: str = "") -> WorkerProcess:
        env = {
            "REDBATCH_EXEC_LOG": str(self.run.exec_log),
            "REDBATCH_FAULTS_SEED": str(self.run.seed),
        }
        if faults:
            env["REDBATCH_FAULTS"] = faults
        worker = WorkerProcess(self.run.config, name, self.run.logdir, env)
        with self._lock:
            self.workers.append(worker)
        threading.Thread(target=self._watch, args=(worker,), daemon=True).start()
        return worker

    def _watch(self, worker: WorkerProcess) -> None:
        rc = worker.proc.wait()
        with self._lock:
            self.exits.append((worker.name, rc, worker.expected_exit))
            self.peak_rss_kb = max(self.peak_rss_kb, worker.peak_rss_kb)
            self.workers.remove(worker)
            closing = self._closing
        replacement = None if closing or rc == 0 else self.restart(worker)
        if replacement is not None:
            self.start(*replacement)
            with self._lock:
                self.restarts += 1
        with self._lock:
            self._changed.notify_all()

    def _sample(self) -> None:
        while True:
            with self._lock:
                if self._closing and not self.workers:
                    return
                for w in self.workers:
                    w.sample_rss()
                    self.peak_rss_kb = max(self.peak_rss_kb, w.peak_rss_kb)
            time.sleep(0.1)  # a sampling period: VmHWM keeps the peak between samples

    def live(self) -> list[WorkerProcess]:
        with self._lock:
            return [w for w in self.workers if w.alive()]

    def wait_ready(self, timeout_s: float = 60.0, count: int | None = None) -> list[WorkerProcess]:
        """Wait until ``count`` (default: all live) workers are registered and warm."""
        r = self.run.r

        def ready() -> bool:
            live = self.live()
            need = len(live) if count is None else count
            return sum(w.is_ready(r) for w in live) >= need > 0

        wait_for(ready, timeout_s, "workers to be ready")
        return [w for w in self.live() if w.is_ready(r)]

    def wait_exits(self, count: int, timeout_s: float) -> None:
        """Block until ``count`` worker exits have been seen in all."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self.exits) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ScenarioTimeout(f"timed out waiting for {count} worker exits")
                self._changed.wait(left)

    @property
    def kills(self) -> int:
        return sum(1 for _, rc, _ in self.exits if rc == -signal.SIGKILL)

    @property
    def crashes(self) -> list[str]:
        """Exits nobody asked for: anything but a SIGKILL (ours or a fault point's) or exit 0."""
        return [f"{n} exited {rc}" for n, rc, _ in self.exits if rc not in (0, -signal.SIGKILL)]

    def stop(self, timeout_s: float = 30.0) -> list[tuple[str, int]]:
        """SIGTERM every worker and wait; returns (name, returncode) of those stopped."""
        with self._lock:
            self._closing = True
            workers = list(self.workers)
        for w in workers:
            w.terminate()
        stopped = []
        for w in workers:
            try:
                stopped.append((w.name, w.proc.wait(timeout=timeout_s)))
            except subprocess.TimeoutExpired:
                w.kill()
                stopped.append((w.name, w.proc.wait()))
        return stopped


# ---------------------------------------------------------------------------------------------
# One scenario's world: Redis, requests, workers, load, and the oracle


@dataclass
class Result:
    """One scenario's figures, as the report's table shows them."""

    name: str
    requests: int = 0
    kills: int = 0
    worker_restarts: int = 0
    redis_restarts: int = 0
    duplicates: int = 0
    lost: int = 0
    malformed: int = 0
    crashes: int = 0
    peak_rss_kb: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.problems


def producer_client(url: str) -> redis.Redis:
    """A producer connection without redis-py's own retries: the load driver retries itself,
    so it knows which XADDs Redis confirmed and which it re-sent."""
    return redis.Redis.from_url(url, socket_timeout=10, retry=Retry(NoBackoff(), 0))


class Run:
    """A scenario's Redis, model, config, requests and worker pool; a context manager."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        seed: int,
        settings: Settings = Settings(),
        redis_args: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.seed = seed
        self.settings = settings
        self.workdir = workdir / name
        self.logdir = self.workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.exec_log = self.workdir / "exec.log"
        self.redis = LocalRedis(*redis_args)
        reference = build_model(self.workdir / "reference.onnx")
        model = build_model(
            self.workdir / "chaos.onnx",
            work_width=settings.work_width,
            work_depth=settings.work_depth,
        )
        self.config = write_config(self.workdir, self.redis.url, model, settings)
        self.requests = Requests(reference, seed)
        self.rng = random.Random(seed)
        self.result = Result(name)
        self.confirmed: set[str] = set()
        self.resent: Counter[str] = Counter()
        self._t0 = time.monotonic()
        self.r: redis.Redis
        self.pool: Pool

    def __enter__(self) -> Run:
        self.redis.start()
        self.r = redis.Redis.from_url(self.redis.url, socket_timeout=30)
        self.pool = Pool(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.pool.stop(timeout_s=10)
        self.r.close()
        self.redis.close()

    # Load ------------------------------------------------------------------------------------

    def send(
        self,
        rids: Sequence[str],
        *,
        rate_per_s: float | None = None,
        chunk: int = 16,
        retry_for_s: float = 60.0,
    ) -> None:
        """XADD ``rids`` in pipelined chunks, paced at ``rate_per_s`` if given. A chunk that fails
        (Redis down, connection killed) is re-sent whole with the same rids until it goes through:
        an XADD whose answer was lost may have been applied, so its rid may appear twice."""
        client = producer_client(self.redis.url)
        start = time.monotonic()
        try:
            for i in range(0, len(rids), chunk):
                part = rids[i : i + chunk]
                if rate_per_s:
                    due = start + i / rate_per_s
                    time.sleep(max(0.0, due - time.monotonic()))  # pacing, not synchronisation
                self._send_chunk(client, part, retry_for_s)
        finally:
            client.close()

    def _send_chunk(self, client: redis.Redis, rids: Sequence[str], retry_for_s: float) -> None:
        deadline = time.monotonic() + retry_for_s
        attempt = 0
        while True:
            pipe = client.pipeline(transaction=False)
            for rid in rids:
                pipe.xadd(STREAM, {"rid": rid, "body": self.requests.bodies[rid]})
            try:
                pipe.execute()
            except (redis.ConnectionError, redis.TimeoutError):
                attempt += 1
                if time.monotonic() > deadline:
                    raise
                self.resent.update(rids)
                time.sleep(min(0.5, 0.02 * 2**attempt))  # backoff while Redis is away
                continue
            self.confirmed.update(rids)
            return

    def send_in_background(self, rids: Sequence[str], **kw: Any) -> threading.Thread:
        failure: list[BaseException] = []

        def target() -> None:
            try:
                self.send(rids, **kw)
            except BaseException as exc:  # reported by join_sender, on the scenario's thread
                failure.append(exc)

        thread = threading.Thread(target=target, name="load", daemon=True)
        thread.failure = failure  # type: ignore[attr-defined]
        thread.start()
        return thread

    def join_sender(self, thread: threading.Thread, timeout_s: float = 120.0) -> None:
        thread.join(timeout_s)
        if thread.is_alive():
            raise ScenarioTimeout("the load driver did not finish")
        failure: list[BaseException] = thread.failure  # type: ignore[attr-defined]
        if failure:
            raise RuntimeError(f"the load driver failed: {failure[0]!r}") from failure[0]

    # State -----------------------------------------------------------------------------------

    def reply_counts(self, rids: Sequence[str]) -> list[int]:
        pipe = self.r.pipeline(transaction=False)
        for rid in rids:
            pipe.llen(reply_key(PREFIX, rid))
        return [int(n) for n in pipe.execute()]

    def drained(self) -> bool:
        """XLEN 0 and nothing pending (a missing stream or group counts as drained)."""
        try:
            if self.r.xlen(STREAM):
                return False
            return all(g["pending"] == 0 for g in self.r.xinfo_groups(STREAM))
        except redis.ResponseError:
            return True

    def consumers(self) -> list[dict[str, Any]]:
        try:
            return list(self.r.xinfo_consumers(STREAM, CONSUMER_GROUP))
        except redis.ResponseError:
            return []

    def pending_of(self, name: str) -> int:
        return next((int(c["pending"]) for c in self.consumers() if c["name"].decode() == name), 0)

    def executions(self) -> Counter[str]:
        if not self.exec_log.exists():
            return Counter()
        return Counter(line.split()[0] for line in self.exec_log.read_text().splitlines() if line)

    # The oracle ------------------------------------------------------------------------------

    def check(
        self,
        rids: Sequence[str],
        *,
        poison: Sequence[str] = (),
        timeout_s: float = 60.0,
        consumer_slack: int = 1,
    ) -> Result:
        """Wait for the replies and a drained stream, then judge everything; fills ``result``."""
        res = self.result
        res.requests = len(rids)
        res.malformed = sum(1 for rid in rids if self.requests.expected[rid].code in _BAD_CODES)
        deadline = time.monotonic() + timeout_s

        with contextlib.suppress(ScenarioTimeout):
            wait_for(
                lambda: min(self.reply_counts(rids), default=1) >= 1, timeout_s, "replies", 0.2
            )
        counts = self.reply_counts(rids)
        missing = [rid for rid, n in zip(rids, counts, strict=True) if n == 0]
        doubled = [rid for rid, n in zip(rids, counts, strict=True) if n > 1]
        res.lost = len(missing)
        if missing:
            res.problems.append(f"{len(missing)} requests got no reply, e.g. {missing[:5]}")
        if doubled:
            res.problems.append(
                f"{len(doubled)} reply lists hold more than one reply: {doubled[:5]}; "
                f"the first: {self.describe_replies(doubled[0])}"
            )
        wrong, ok = self._judge_replies([rid for rid, n in zip(rids, counts, strict=True) if n])
        res.problems += wrong

        left = max(1.0, deadline - time.monotonic())
        try:
            wait_for(self.drained, left, "an empty stream with nothing pending", 0.2)
        except ScenarioTimeout as exc:
            res.problems.append(f"{exc}: XLEN {self.r.xlen(STREAM)}, groups {self._groups()}")

        letters: list[tuple[bytes, dict[bytes, bytes]]] = self.r.xrange(DEAD)  # type: ignore[assignment]
        dead = [f[b"rid"].decode() for _, f in letters if b"rid" in f]
        reasons = [f.get(b"reason") for _, f in letters]
        if sorted(dead) != sorted(poison):
            res.problems.append(
                f"dead-letter stream holds {sorted(dead)}, expected {sorted(poison)}"
            )
        if not all(reasons):
            res.problems.append("a dead letter has no reason")
        res.notes["dead_reasons"] = sorted({(r or b"").decode() for r in reasons})

        live = len(self.pool.live())
        bound = live + consumer_slack
        left = max(1.0, deadline - time.monotonic(), 4 * self.settings.claim_idle_ms / 1000 + 2)
        with contextlib.suppress(ScenarioTimeout):
            wait_for(lambda: len(self.consumers()) <= live, left, "dead consumers removed", 0.2)
        names = [c["name"].decode() for c in self.consumers()]
        res.notes["consumers_at_end"] = len(names)
        if len(names) > bound:
            res.problems.append(f"{len(names)} consumers for {live} live workers: {names}")

        execs = self.executions()
        res.duplicates = sum(
            n - 1 for rid, n in execs.items() if n > 1 and rid in self.requests.bodies
        )
        unlogged = [rid for rid in ok if not execs[rid]]
        if unlogged:  # the count above would be meaningless
            res.problems.append(f"{len(unlogged)} answered requests not in REDBATCH_EXEC_LOG")
        res.notes["resent_by_producer"] = sum(self.resent.values())
        return self.finish()

    def describe_replies(self, rid: str) -> str:
        """Every reply in ``rid``'s list (worker, outcome) and its executions, for a report."""
        raws: list[bytes] = self.r.lrange(reply_key(PREFIX, rid), 0, -1)  # type: ignore[assignment]
        seen = []
        for raw in raws:
            reply = decode_reply(raw)
            outcome = reply.error.code if reply.error else "OK"
            seen.append(
                f"{reply.worker}:{outcome}:queued {reply.timings_ms.get('queued', 0):.0f}ms"
            )
        return f"replies {seen}, executions {self.executions()[rid]}, sent {1 + self.resent[rid]}x"

    def _groups(self) -> list[dict[str, Any]]:
        with contextlib.suppress(redis.ResponseError):
            return list(self.r.xinfo_groups(STREAM))
        return []

    def _judge_replies(self, rids: Sequence[str]) -> tuple[list[str], list[str]]:
        """(problems, rids answered with outputs) for requests that have a reply."""
        pipe = self.r.pipeline(transaction=False)
        for rid in rids:
            pipe.lindex(reply_key(PREFIX, rid), 0)
        wrong: list[str] = []
        ok: list[str] = []
        for rid, raw in zip(rids, pipe.execute(), strict=True):
            want = self.requests.expected[rid]
            try:
                reply = decode_reply(raw)
            except WireFormatError as exc:
                wrong.append(f"{rid}: undecodable reply ({exc})")
                continue
            if reply.rid != rid:
                wrong.append(f"{rid}: reply names rid {reply.rid}")
            elif want.code is not None:
                got = reply.error.code if reply.error else "OK"
                if got != want.code:
                    wrong.append(f"{rid}: expected {want.code}, got {got}")
            elif not reply.ok or reply.outputs is None:
                wrong.append(f"{rid}: expected outputs, got {reply.error}")
            elif want.y is None or not np.allclose(reply.outputs["y"], want.y, 1e-5, 1e-6):
                wrong.append(f"{rid}: outputs differ from the direct onnxruntime run")
            else:
                ok.append(rid)
        return ([f"{len(wrong)} wrong replies: {wrong[:5]}"] if wrong else []), ok

    def finish(self) -> Result:
        """Worker figures into the result (call after the oracle; stops nothing)."""
        res = self.result
        res.kills = self.pool.kills
        res.worker_restarts = self.pool.restarts
        crashes = self.pool.crashes
        res.crashes = len(crashes)
        if crashes:
            res.problems.append(f"workers crashed: {crashes}")
        for w in self.pool.live():
            w.sample_rss()
            res.peak_rss_kb = max(res.peak_rss_kb, w.peak_rss_kb)
        res.peak_rss_kb = max(res.peak_rss_kb, self.pool.peak_rss_kb)
        res.seconds = round(time.monotonic() - self._t0, 1)
        return res

    def worker_logs(self) -> str:
        """Every worker log's tail, for a failure message."""
        parts = []
        for path in sorted(self.logdir.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-8:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)


_BAD_CODES = frozenset({"MALFORMED", "INVALID_INPUT"})


# ---------------------------------------------------------------------------------------------
# Scenarios: each takes its sizes, runs in its own Redis and workdir, and returns a Result.


def random_kills(
    workdir: Path,
    *,
    requests: int = 1000,
    workers: int = 2,
    kills: int = 3,
    duration_s: float = 10.0,
    seed: int = 1,
) -> Result:
    """SIGKILL a serving worker at random moments under paced load (one holding entries when
    there is one); each is restarted, half the time under its old name (it takes back its own
    pending entries), half under a new one (another worker must claim them, and the dead
    consumer must be removed)."""
    s = Settings(claim_idle_ms=1000, max_wait_ms=50, work_width=512, work_depth=4)
    with Run("random-kills", workdir, seed, s) as run:
        generation = Counter[str]()
        names = random.Random(seed + 1)  # used on the pool's watcher threads

        def restart(w: WorkerProcess) -> tuple[str, str]:
            base = w.name.split("-r")[0]
            if names.random() < 0.5:
                return w.name, ""
            generation[base] += 1
            return f"{base}-r{generation[base]}", ""

        run.pool.restart = restart
        rids = run.requests.make(requests, "rk", bad_fraction=0.03)
        for i in range(workers):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        sender = run.send_in_background(rids, rate_per_s=requests / duration_s, chunk=4)
        start = time.monotonic()
        times = sorted(run.rng.uniform(0.3, duration_s) for _ in range(kills))
        holding = 0
        for t in times:
            time.sleep(max(0.0, start + t - time.monotonic()))  # the kill schedule
            ready = run.pool.wait_ready(count=1)
            pending = {c["name"].decode(): int(c["pending"]) for c in run.consumers()}
            busy = [w for w in ready if pending.get(w.name)]
            victim = run.rng.choice(busy or ready)
            holding += bool(busy)
            victim.kill()
        run.join_sender(sender)
        run.pool.wait_ready(count=workers)
        run.result.notes["kills_with_entries_in_hand"] = holding
        res = run.check(rids, timeout_s=60)
        if res.kills < kills:
            res.problems.append(f"only {res.kills} of {kills} kills happened")
        return res


def phase_kills(
    workdir: Path,
    point: str,
    *,
    requests: int = 300,
    workers: int = 2,
    kills: int = 1,
    seed: int = 2,
) -> Result:
    """One worker armed to SIGKILL itself at ``point`` (each time it gets there) until ``kills``
    deaths; each replacement gets a new name, so its entries must be claimed by another worker."""
    s = Settings(claim_idle_ms=800, max_wait_ms=10, work_depth=2)
    with Run(f"kill-{point}", workdir, seed, s) as run:
        armed = f"{point}=kill"
        deaths = Counter[str]()

        def restart(w: WorkerProcess) -> tuple[str, str]:
            deaths["n"] += 1
            return f"a{deaths['n']}", armed if deaths["n"] < kills else ""

        run.pool.restart = restart
        rids = run.requests.make(requests, point, bad_fraction=0.02)
        run.pool.start("a0", armed)
        run.pool.wait_ready()
        sender = run.send_in_background(rids, rate_per_s=requests / 2.0)
        for i in range(1, workers):
            run.pool.start(f"w{i}")
        run.join_sender(sender)
        deadline = time.monotonic() + 60
        while run.pool.kills < kills and time.monotonic() < deadline:
            # The armed replacement came up after the load: give it work until it dies.
            run.pool.wait_ready(count=workers)
            extra = run.requests.make(2 * s.max_batch_size, point)
            rids += extra
            run.send(extra)
            with contextlib.suppress(ScenarioTimeout):
                run.pool.wait_exits(len(run.pool.exits) + 1, timeout_s=3)
        run.pool.wait_ready(count=workers)
        res = run.check(rids, timeout_s=60)
        if res.kills < kills:
            res.problems.append(f"only {res.kills} of {kills} kills at {point} happened")
        return res


def fault_storm(
    workdir: Path,
    *,
    requests: int = 1000,
    workers: int = 2,
    kills: int = 3,
    probability: float = 0.02,
    duration_s: float = 8.0,
    seed: int = 9,
) -> Result:
    """Every worker armed at all four fault points with ``probability`` per hit, restarted armed
    (under its old name) until ``kills`` deaths, then clean: kills at random points in the code."""
    s = Settings(claim_idle_ms=800, max_wait_ms=20, work_depth=4)
    with Run("fault-storm", workdir, seed, s) as run:
        armed = ",".join(f"{p}=kill:{probability}" for p in POINTS)
        deaths = Counter[str]()

        def restart(w: WorkerProcess) -> tuple[str, str]:
            deaths["n"] += 1
            return w.name, armed if deaths["n"] < kills else ""

        run.pool.restart = restart
        rids = run.requests.make(requests, "fs", bad_fraction=0.02)
        for i in range(workers):
            run.pool.start(f"w{i}", armed)
        run.pool.wait_ready()
        run.send(rids, rate_per_s=requests / duration_s, chunk=4)
        with contextlib.suppress(ScenarioTimeout):
            run.pool.wait_exits(kills, timeout_s=30)
        run.pool.wait_ready(count=workers)
        res = run.check(rids, timeout_s=60)
        if res.kills < kills:
            res.problems.append(f"only {res.kills} of {kills} kills at fault points happened")
        return res


def redis_restart(
    workdir: Path,
    appendfsync: str,
    *,
    requests: int = 1000,
    workers: int = 2,
    restarts: int = 1,
    duration_s: float = 6.0,
    down_s: float = 1.0,
    lose_tail_kb: int = 0,
    seed: int = 3,
) -> Result:
    """SIGKILL Redis (AOF on) mid-run and start it again ``down_s`` later. With ``always``
    nothing XADD confirmed may be lost and nothing confirmed is re-sent. A killed process loses
    nothing it wrote, so for ``everysec`` ``lose_tail_kb`` cuts the AOF's last KiB, as a power
    cut before the next fsync would; the producer then re-sends, with the same rid, what has no
    reply once the stream is drained, and everything must be answered once."""
    s = Settings(claim_idle_ms=1000, max_wait_ms=10, work_depth=2)
    args = ("--appendonly", "yes", "--appendfsync", appendfsync)
    with Run(f"redis-restart-{appendfsync}", workdir, seed, s, redis_args=args) as run:
        rids = run.requests.make(requests, f"aof-{appendfsync}", bad_fraction=0.02)
        for i in range(workers):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        sender = run.send_in_background(rids, rate_per_s=requests / duration_s)
        start = time.monotonic()
        for k in range(restarts):
            due = start + duration_s * (k + 1) / (restarts + 1) * run.rng.uniform(0.8, 1.2)
            time.sleep(max(0.0, due - time.monotonic()))  # the restart schedule
            run.redis.stop(kill=True)
            if lose_tail_kb:
                cut = _cut_aof_tail(run.redis.dir, lose_tail_kb)
                run.result.notes["aof_bytes_cut"] = run.result.notes.get("aof_bytes_cut", 0) + cut
            time.sleep(down_s)  # the outage itself
            run.redis.start()
            run.result.redis_restarts += 1
        run.join_sender(sender)
        if appendfsync != "always":
            with contextlib.suppress(ScenarioTimeout):
                wait_for(run.drained, 60, "the stream to drain before re-sending", 0.2)
            unanswered = [rid for rid, n in zip(rids, run.reply_counts(rids), strict=True) if not n]
            run.result.notes["recovered_by_resend"] = len(unanswered)
            run.resent.update(unanswered)
            run.send(unanswered)
        res = run.check(rids, timeout_s=60)
        if appendfsync == "always":
            lost_confirmed = res.lost  # only chunks that failed were re-sent, never confirmed ones
            res.notes["confirmed_lost"] = lost_confirmed
        return res


def _cut_aof_tail(redis_dir: Path, kib: int) -> int:
    """Drop about the last ``kib`` KiB of the newest AOF increment, cutting at a command
    boundary outside any MULTI block, as if the writes since the last fsync never reached disk.

    Not a torn write: Redis 7.0.15 loads an AOF cut inside MULTI by dropping the open block but
    leaves it in the file, and the next EXEC written after it resurrects it on a later restart
    (seen here as a reply pushed twice); that is Redis's bug, not the worker's.
    """
    incr = sorted((redis_dir / "appendonlydir").glob("*.incr.aof"), key=lambda p: p.stat().st_mtime)
    if not incr:
        return 0
    data = incr[-1].read_bytes()
    target = max(0, len(data) - kib * 1024)
    keep = 0
    pos = 0
    in_multi = False
    while pos < len(data) and data[pos : pos + 1] == b"*":
        if not in_multi and pos <= target:
            keep = pos
        end = data.index(b"\r\n", pos)
        count = int(data[pos + 1 : end])
        name = b""
        pos = end + 2
        for i in range(count):
            end = data.index(b"\r\n", pos)
            size = int(data[pos + 1 : end])
            if i == 0:
                name = data[end + 2 : end + 2 + size].upper()
            pos = end + 2 + size + 2
        in_multi = (in_multi or name == b"MULTI") and name != b"EXEC"
    os.truncate(incr[-1], keep)
    return len(data) - keep


def client_kills(
    workdir: Path,
    *,
    requests: int = 1000,
    workers: int = 2,
    duration_s: float = 8.0,
    interval_s: float = 1.0,
    seed: int = 4,
) -> Result:
    """``CLIENT KILL TYPE normal`` every ``interval_s`` under paced load: every worker and the
    producer lose their connections again and again."""
    s = Settings(claim_idle_ms=1000, max_wait_ms=10, work_depth=2)
    with Run("client-kill", workdir, seed, s) as run:
        rids = run.requests.make(requests, "ck", bad_fraction=0.02)
        for i in range(workers):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        sender = run.send_in_background(rids, rate_per_s=requests / duration_s)
        killer = redis.Redis.from_url(run.redis.url)
        stop = threading.Event()
        killed = rounds = 0
        while not stop.wait(interval_s * run.rng.uniform(0.5, 1.5)):
            killed += int(killer.execute_command("CLIENT", "KILL", "TYPE", "normal"))
            rounds += 1
            if not sender.is_alive():
                stop.set()
        killer.close()
        run.join_sender(sender)
        run.result.notes.update(client_kill_rounds=rounds, connections_killed=killed)
        return run.check(rids, timeout_s=60)


def flushall(
    workdir: Path,
    *,
    before: int = 1500,
    after: int = 300,
    workers: int = 2,
    seed: int = 5,
) -> Result:
    """FLUSHALL while the workers drain a backlog. What was flushed is gone by definition; every
    request sent after the flush must be answered once, and no request may get two replies."""
    s = Settings(claim_idle_ms=1000, max_wait_ms=10, work_depth=6)
    with Run("flushall", workdir, seed, s) as run:
        first = run.requests.make(before, "pre")
        second = run.requests.make(after, "post", bad_fraction=0.02)
        for i in range(workers):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        run.send(first, chunk=64)
        wait_for(lambda: run.r.exists(reply_key(PREFIX, first[0])) > 0, 30, "the first reply")
        backlog = run.r.xlen(STREAM)
        run.r.flushall()
        run.result.notes["backlog_at_flush"] = backlog
        run.send(second, rate_per_s=after / 2.0)
        res = run.check(second, timeout_s=60)
        counts = run.reply_counts(first)
        res.notes["flushed_unanswered"] = sum(1 for n in counts if n == 0)
        if any(n > 1 for n in counts):
            res.problems.append("a request from before the flush got two replies")
        res.problems += run._judge_replies(
            [rid for rid, n in zip(first, counts, strict=True) if n]
        )[0]
        res.notes["sent_before_flush"] = before
        return res


def crash_pill(
    workdir: Path,
    *,
    healthy: int = 31,
    workers: int = 2,
    max_deliveries: int = 3,
    claim_idle_ms: int = 600,
    seed: int = 6,
) -> Result:
    """A request that kills its worker inside inference, in one batch with ``healthy`` others.
    Dead workers come back under the same name. The pill must end POISONED in the dead-letter
    stream after at most ``max_deliveries`` deliveries; the healthy ones must all succeed."""
    s = Settings(claim_idle_ms=claim_idle_ms, max_deliveries=max_deliveries, max_wait_ms=200)
    with Run("crash-pill", workdir, seed, s) as run:
        rids = run.requests.make(healthy, "cp")
        pill = run.requests.pill("cp")
        rids.insert(run.rng.randrange(len(rids) + 1), pill)
        run.send(rids, chunk=len(rids))  # all in the stream before any worker reads: one batch
        run.pool.restart = lambda w: (w.name, w.faults)
        for i in range(workers):
            run.pool.start(f"w{i}", f"crash_value={CRASH_VALUE}")
        res = run.check(rids, poison=[pill], timeout_s=60)
        execs = run.executions()
        res.notes["pill_executions"] = execs[pill]
        res.notes["healthy_max_executions"] = max(execs[r] for r in rids if r != pill)
        if res.kills > max_deliveries:
            res.problems.append(
                f"{res.kills} workers died for one pill (max_deliveries {max_deliveries})"
            )
        if res.duplicates:
            res.problems.append(f"{res.duplicates} duplicate executions: the crashed run counted?")
        if execs[pill] > max_deliveries:
            res.problems.append(f"the pill ran {execs[pill]} times")
        if res.kills == 0:
            res.problems.append("the pill never killed a worker: the scenario tested nothing")
        return res


def slow_batch(
    workdir: Path,
    *,
    requests: int = 128,
    workers: int = 2,
    claim_idle_ms: int = 300,
    seed: int = 7,
) -> Result:
    """Batches that run about 3 x ``claim_idle_ms``: lease renewal must keep other workers from
    claiming them, so nothing runs twice."""
    depth = slow_depth(3 * claim_idle_ms)
    s = Settings(claim_idle_ms=claim_idle_ms, max_wait_ms=50, work_width=1024, work_depth=depth)
    with Run("slow-batch", workdir, seed, s) as run:
        rids = run.requests.make(requests, "sb")
        for i in range(workers):
            run.pool.start(f"w{i}")
        run.pool.wait_ready()
        run.send(rids, rate_per_s=requests / 2.0)
        res = run.check(rids, timeout_s=120)
        slowest = _slowest_inference_ms(run, rids)
        res.notes["slowest_batch_ms"] = round(slowest)
        if slowest <= claim_idle_ms:
            res.problems.append(f"no batch ran longer than claim_idle_ms ({slowest:.0f} ms)")
        if res.duplicates:
            res.problems.append(f"{res.duplicates} requests ran twice despite lease renewal")
        return res


def _slowest_inference_ms(run: Run, rids: Sequence[str]) -> float:
    pipe = run.r.pipeline(transaction=False)
    for rid in rids:
        pipe.lindex(reply_key(PREFIX, rid), 0)
    times = [decode_reply(raw).timings_ms.get("inference", 0.0) for raw in pipe.execute() if raw]
    return max(times, default=0.0)


def sigterm_mid_batch(
    workdir: Path,
    *,
    requests: int = 160,
    grace_s: float = 20.0,
    batch_ms: int = 800,
    seed: int = 8,
) -> Result:
    """SIGTERM while a slow batch (about ``batch_ms``) runs: exit 0 within ``grace_s``, nothing
    left pending on it, its consumer gone; a second worker then serves the rest, and nothing ran
    twice."""
    depth = slow_depth(batch_ms)
    s = Settings(claim_idle_ms=1000, max_wait_ms=50, work_width=1024, work_depth=depth)
    with Run("sigterm", workdir, seed, s) as run:
        rids = run.requests.make(requests, "st")
        first = run.pool.start("term")
        run.pool.wait_ready()
        run.send(rids, chunk=64)
        wait_for(lambda: run.pending_of("term") > 0, 30, "the worker to hold a batch")
        t0 = time.monotonic()
        first.terminate()
        try:
            rc = first.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        res = run.result
        res.notes["stop_s"] = round(took, 2)
        if rc != 0:
            res.problems.append(f"SIGTERM: exit {rc} after {took:.1f}s (grace {grace_s}s)")
        if run.pending_of("term"):
            res.problems.append("entries left pending on the stopped worker")
        if "term" in [c["name"].decode() for c in run.consumers()]:
            res.problems.append("the stopped worker's consumer is still in the group")
        run.pool.start("after")
        run.check(rids, timeout_s=120)
        if res.duplicates:
            res.problems.append(f"{res.duplicates} requests ran twice")
        return res


SCENARIOS: dict[str, Callable[..., Result]] = {
    "random_kills": random_kills,
    "phase_kills": phase_kills,
    "fault_storm": fault_storm,
    "redis_restart": redis_restart,
    "client_kills": client_kills,
    "flushall": flushall,
    "crash_pill": crash_pill,
    "slow_batch": slow_batch,
    "sigterm_mid_batch": sigterm_mid_batch,
}


def describe(res: Result) -> str:
    """A failure message: the figures and every problem the oracle found."""
    lines = [f"scenario {res.name}: {res}"] + [f"  - {p}" for p in res.problems]
    return "\n".join(lines)
