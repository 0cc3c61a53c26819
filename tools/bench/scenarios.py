"""The fixed presets (``SCENARIOS``): what each runs, and the ceilings it is compared with.

Each preset is fixed, so runs on different days or commits compare. ``python -m tools.bench
--scenario NAME`` runs one; ``runner.Bench`` first measures the union of the chosen presets'
ceilings (bare ``session.run`` at their batch sizes, the Redis protocol alone, the asyncio
batcher), then calls each preset's ``run`` with itself, typed as the ``phases.Phases`` it
drives. The drain preset lives in ``drain.py``, the pipeline preset in ``pipelines.py``.

A preset whose targets set a phase against a ceiling names them as ``Paired``: with
``--rounds N`` the bench measures each such ceiling and its phase again N times, back to back,
and judges the target by the median ratio (``runner.Bench.rounds``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tools.bench.drain import drain
from tools.bench.lanes import lanes_backlog
from tools.bench.load import CALLERS
from tools.bench.phases import Phases
from tools.bench.pipelines import image_again, pipelines, threads_again
from tools.bench.processes import WorkerSetup
from tools.bench.tenants import lanes_tenants

__all__ = ["SCENARIOS", "Paired", "Scenario"]


@dataclass(frozen=True, slots=True)
class Paired:
    """A target that sets a phase's throughput against a ceiling measured in the same run:
    ``ceiling(bench)`` measures that ceiling again, without keeping it in the report."""

    target: str
    phase: str
    ceiling: Callable[[Phases], float]


@dataclass(frozen=True, slots=True)
class Scenario:
    """A fixed preset: what it runs, and the ceilings it is compared with."""

    run: Callable[[Phases], None]
    about: str
    bare: tuple[tuple[str, tuple[int, ...]], ...] = ()
    protocol: tuple[str, ...] = ()
    asyncio: tuple[str, ...] = ()
    paired: tuple[Paired, ...] = ()


def _closed(callers: int) -> dict[str, Any]:
    return {"mode": "closed", "concurrency": callers}


def _tiny_closed(b: Phases) -> None:
    b.phase("tiny-closed", WorkerSetup("tiny", 32, b.o.max_wait_ms), _closed(CALLERS))


def _single_caller(b: Phases) -> None:
    for model in ("tiny", "heavy"):
        b.phase(f"single-caller/{model}", WorkerSetup(model, 32, b.o.max_wait_ms), _closed(1))


def _heavy_closed(b: Phases) -> None:
    for size in (1, 32):
        setup = WorkerSetup("heavy", size, b.o.max_wait_ms)
        b.phase(f"heavy-closed/mbs{size}", setup, _closed(CALLERS))


def _poisson_half(b: Phases) -> None:
    setup = WorkerSetup("heavy", 32, b.o.max_wait_ms)
    rate = b.closed_max(setup, "poisson-half") / 2
    b.phase("poisson-half/poisson", setup, {"mode": "poisson", "rate_per_s": rate})
    load = {"mode": "bursty", "rate_per_s": rate, "burst_size": 16}
    b.phase("poisson-half/bursty", setup, load)


def _sweep(b: Phases) -> None:
    setup = WorkerSetup("heavy", 32, b.o.max_wait_ms)
    top = b.closed_max(setup, "sweep")
    for callers in (1, 4, 16, 64, 128):
        b.phase(f"sweep/closed-C{callers}", setup, _closed(callers), series="heavy closed loop")
    for share in (0.25, 0.5, 0.75, 0.9):
        load = {"mode": "poisson", "rate_per_s": share * top}
        b.phase(f"sweep/poisson-{share:g}", setup, load, series="heavy Poisson")


def _protocol_again(b: Phases) -> float:
    """The protocol ceiling again, for a round of tiny-closed."""
    source = ("--model-file", str(b.model_file("tiny")))
    return float(b.protocol("tiny", source, 32, keep=False)["throughput_per_s"])


def _bare_again(b: Phases) -> float:
    """Bare heavy at batch 32 again, for a round of heavy-closed."""
    return float(b.bare("heavy", [32], keep=False)["batch"]["32"]["rows_per_s"])


def _asyncio_again(b: Phases) -> float:
    """The asyncio batcher again, for a round of heavy-closed."""
    return float(b.asyncio_batcher("heavy", keep=False)["throughput_per_s"])


SCENARIOS: dict[str, Scenario] = {
    "tiny-closed": Scenario(
        _tiny_closed,
        f"tiny model, {CALLERS} closed-loop callers, vs the Redis-protocol-only ceiling",
        bare=(("tiny", (1, 32)),),
        protocol=("tiny",),
        paired=(Paired("tiny-vs-protocol", "tiny-closed", _protocol_again),),
    ),
    "single-caller": Scenario(
        _single_caller,
        "one caller at a time, tiny and heavy: p50 vs bare batch-1 run time",
        bare=(("tiny", (1,)), ("heavy", (1,))),
    ),
    "heavy-closed": Scenario(
        _heavy_closed,
        f"heavy model, {CALLERS} closed-loop callers, max_batch_size 1 and 32, "
        "vs bare session.run and an in-process asyncio batcher",
        bare=(("heavy", (1, 32)),),
        asyncio=("heavy",),
        paired=(  # measured in this order: bare session.run just before the phase
            Paired("heavy-vs-asyncio", "heavy-closed/mbs32", _asyncio_again),
            Paired("heavy-vs-bare", "heavy-closed/mbs32", _bare_again),
        ),
    ),
    "poisson-half": Scenario(
        _poisson_half,
        "heavy model, Poisson (and bursty) arrivals at half the closed-loop maximum",
        bare=(("heavy", (32,)),),
    ),
    "sweep": Scenario(
        _sweep,
        "heavy model: closed loop at 1 to 128 callers, Poisson at 25 to 90% of the maximum",
        bare=(("heavy", (1, 32)),),
    ),
    "pipeline": Scenario(
        pipelines,
        "pipelines: a preprocessing-bound one at threads 2 vs 1; the image example vs its "
        "preprocessing alone and bare session.run",
        paired=(
            Paired("pipeline-threads", "pipeline/cpu-t2", threads_again),
            Paired("pipeline-image", "pipeline/image", image_again),
        ),
    ),
    "drain": Scenario(
        drain,
        "100,000 tiny requests enqueued, then a worker started: drain rate, peak vs idle RSS",
    ),
    "lanes-backlog": Scenario(
        lanes_backlog,
        "heavy: a high caller alone, then behind 1,000,000 low and 100,000 normal rows "
        "(--lane-*): its p99, and the backlog's drain rate with and without it",
    ),
    "lanes-tenants": Scenario(
        lanes_tenants,
        "heavy: two backlogged tenants of one class at weights 1:1 and 3:1, rows per 100 "
        "batches; the low class's share under a saturating high backlog (--tenant-*)",
    ),
}
