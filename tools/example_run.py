"""``python -m tools.example_run image|text``: one example end to end, checked.

Fetches the example's model (``scripts/fetch_models.py``), uses REDIS_URL when it answers (or
starts a throwaway redis-server), starts a worker on ``examples/<name>/config.toml``, sends a few
generated inputs through ``producer.Client``, and prints each served answer next to a direct run
of the same handler and model without Redis (``examples.common.reference``). Exits 1 when any
answer differs, 2 when something could not be started.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import redis

from examples.common.reference import DirectRun, same_outputs
from examples.image.handler import OrientationPipeline, sample_page
from examples.text.handler import SentenceEmbedding
from producer import Client
from producer.keys import DEFAULT_PREFIX, workers_key
from tools.localredis import LocalRedis, RedisNotInstalled

ROOT = Path(__file__).resolve().parents[1]
Inputs = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class Example:
    """What differs between the examples: the model's queue, the handler, inputs, a printout."""

    model: str
    handler: type
    requests: Callable[[], list[Inputs]]
    show: Callable[[Inputs, Inputs, Inputs], None]


def _image_requests() -> list[Inputs]:
    """Generated pages at each turn, as PNG and as JPEG, one request each, then one of four."""
    single = [
        {"image": np.array([sample_page(fmt=fmt, angle=angle)], dtype=object)}
        for fmt in ("PNG", "JPEG")
        for angle in (0, 90, 180, 270)
    ]
    four = [sample_page(1200, 900, "JPEG", angle) for angle in (0, 90, 180, 270)]
    return [*single, {"image": np.array(four, dtype=object)}]


def _show_image(inputs: Inputs, got: Inputs, want: Inputs) -> None:
    for i, data in enumerate(inputs["image"]):
        kind = "PNG" if data.startswith(b"\x89PNG") else "JPEG"
        print(
            f"  {kind:4} {len(data):7d} bytes  served {got['label'][i]:>3} "
            f"({got['score'][i]:.4f})  direct {want['label'][i]:>3} ({want['score'][i]:.4f})",
            flush=True,
        )


SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "The new film is so great.",
    "A cat sits outside in the sun.",
    "Redis streams hold the requests, and each worker reads a batch of them, runs the model once "
    "for the whole batch, and writes every request's reply to its own key.",
]


def _text_requests() -> list[Inputs]:
    """Each sentence alone, then two paraphrases in one request."""
    single = [{"text": np.array([s], dtype=object)} for s in SENTENCES]
    return [*single, {"text": np.array(SENTENCES[:2], dtype=object)}]


def _show_text(inputs: Inputs, got: Inputs, want: Inputs) -> None:
    for i, text in enumerate(inputs["text"]):
        head = " ".join(f"{v:+.3f}" for v in got["embedding"][i][:4])
        diff = float(np.max(np.abs(got["embedding"][i] - want["embedding"][i])))
        shown = repr(text if len(text) <= 36 else text[:33] + "...")
        print(f"  {shown:38} [{head} ...]  max |served - direct| {diff:.1e}", flush=True)
    if len(inputs["text"]) == 2:
        cosine = float(got["embedding"][0] @ got["embedding"][1])
        print(f"  cosine similarity of the two above: {cosine:.3f}", flush=True)


EXAMPLES = {
    "image": Example("orientation", OrientationPipeline, _image_requests, _show_image),
    "text": Example("minilm", SentenceEmbedding, _text_requests, _show_text),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.example_run",
        description="Run one redbatch example end to end and check it against a direct run.",
    )
    parser.add_argument("example", choices=sorted(EXAMPLES), help="which example to run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    example = EXAMPLES[args.example]
    fetch = [sys.executable, str(ROOT / "scripts" / "fetch_models.py"), args.example]
    if subprocess.run(fetch, check=False).returncode != 0:
        return 2
    config = ROOT / "examples" / args.example / "config.toml"
    requests = example.requests()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(_redis())
        stack.enter_context(_worker(url, config, example.model))
        with Client(example.model, url) as client:
            rids = client.submit_many(requests)
            served = [client.wait(rid, timeout_s=120) for rid in rids]
    direct = _direct_run(example, config)
    failures = 0
    for inputs, result in zip(requests, served, strict=True):
        if not result.ok or result.outputs is None:
            error = result.error
            why = f"{error.code}: {error.message}" if error else "no outputs"
            print(f"request {result.rid[:8]} FAILED: {why}", flush=True)
            failures += 1
            continue
        want = direct(inputs)
        print(f"request {result.rid[:8]} ran in a batch of {result.batch_rows} rows:", flush=True)
        example.show(inputs, result.outputs, want)
        problems = same_outputs(result.outputs, want)
        for problem in problems:
            print(f"  MISMATCH {problem}", flush=True)
        failures += bool(problems)
    verdict = "all match" if not failures else f"{failures} request(s) DO NOT match"
    print(f"example {args.example}: served answers vs a direct run: {verdict}", flush=True)
    return 1 if failures else 0


def _direct_run(example: Example, config: Path) -> DirectRun:
    """The example's handler and model without Redis, built as the config builds them."""
    table = tomllib.loads(config.read_text(encoding="utf-8"))
    handler = example.handler(**table["pipeline"].get("options", {}))
    return DirectRun(handler, config.parent / table["model"]["path"])


def _fail(message: str) -> NoReturn:
    print(f"example: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# -- Redis and the worker, started and stopped here ---------------------------------------------


@contextlib.contextmanager
def _redis() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url and _answers(url):
        print(f"example: using Redis at REDIS_URL ({url.split('@')[-1]})", flush=True)
        yield url
        return
    try:
        server = LocalRedis()
    except RedisNotInstalled as exc:
        _fail(f"REDIS_URL does not answer, and {exc}")
    with server:
        print(f"example: started a throwaway redis-server on port {server.port}", flush=True)
        yield server.url


def _answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        with contextlib.closing(client):
            return bool(client.ping())
    except redis.RedisError:
        return False


@contextlib.contextmanager
def _worker(url: str, config: Path, model: str) -> Iterator[None]:
    cmd = [sys.executable, "-m", "worker", "--config", str(config), "--name", f"{model}-example"]
    print(f"example: starting a worker: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, env=dict(os.environ, REDIS_URL=url), cwd=ROOT)
    try:
        _wait_ready(url, model, proc)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"example: worker stopped (exit code {proc.returncode})", flush=True)


def _wait_ready(
    url: str, model: str, proc: subprocess.Popen[bytes], timeout_s: float = 180
) -> None:
    """Wait until the worker's record appears in Redis (it registers once warm)."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    with contextlib.closing(client):
        while not client.scard(workers_key(DEFAULT_PREFIX, model)):
            if proc.poll() is not None:
                _fail(f"the worker exited with code {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                _fail(f"the worker was not ready within {timeout_s:.0f} s")
            time.sleep(0.1)  # a child process gives no readiness event to wait on


if __name__ == "__main__":
    sys.exit(main())
