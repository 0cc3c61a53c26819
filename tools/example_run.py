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
import subprocess
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from examples.common.reference import DirectRun, same_outputs
from examples.image.handler import OrientationPipeline, sample_page
from examples.text.handler import SentenceEmbedding
from producer import Client
from tools.services import redis_url, worker_process

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
        url = stack.enter_context(redis_url("example"))
        name = f"{example.model}-example"
        stack.enter_context(worker_process("example", url, config, example.model, name))
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
        rows = f"{result.batch_rows} row{'s' if result.batch_rows != 1 else ''}"
        print(f"request {result.rid[:8]} ran in a batch of {rows}:", flush=True)
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


if __name__ == "__main__":
    sys.exit(main())
