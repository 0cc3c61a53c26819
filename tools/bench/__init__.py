"""The load test, ``python -m tools.bench``: every figure set against its ceiling.

The producer never imports the worker or onnxruntime, so the bench orchestrates processes:

- ``python -m worker`` workers it starts from a generated config (metrics port on), or workers
  already serving (``--no-start``);
- ``python -m tools.benchkit``: model files, and the ceilings measured in the same run (bare
  ``session.run``, the Redis protocol alone, an in-process asyncio batcher), each as JSON;
- producer processes (``multiprocessing``, spawn) that drive the load: closed loop (C callers,
  one reply in, one request out) or open loop (Poisson or bursty arrivals at a rate), pipelining
  submits and waiting on many reply keys per round trip.

The modules, from the bottom up:

- ``wire``: one producer's requests and replies, made cheap; ``load``: the load, its producer
  processes and what they measured;
- ``metrics``: the worker's /metrics diffed, CPU and memory from /proc; ``processes``: the
  redis-server (or local cluster), workers and benchkit runs the bench starts; ``shards``: a
  model's shards placed on distinct masters (``--cluster --shards N``), and Redis CPU per
  request by master; ``provenance``: what the figures depend on (machine, versions, commit);
- ``runner``: one run (ceilings, phases, the report); ``scenarios``, ``drain``,
  ``pipelines``, ``lanes`` and ``tenants``: the presets (``laneopts``: the lanes presets'
  sizes on the command line); ``burn``: the preprocessing-bound handler the pipeline preset
  serves; ``hooks``: a pipeline's preprocessing alone on N threads (run as a process, like
  ``tools.benchkit``);
- ``report``, ``pipereport`` and ``lanereport``: targets, tables, JSON, chart; ``cli``: the
  ``python -m tools.bench`` options.

This package exports what ``tools.bench.__main__`` runs (``add_arguments``, ``run_command``), the
pure pieces the tests check, and what ``tools.benchkit`` drives its protocol-only ceiling with
(``LoadSpec``, ``run_load``, ``input_rows``).
"""

from __future__ import annotations

from tools.bench.cli import add_arguments, run_command
from tools.bench.load import LoadSpec, arrivals, percentiles, run_load
from tools.bench.metrics import cpu_cores, worker_view
from tools.bench.report import format_report, plot, targets
from tools.bench.wire import input_rows

__all__ = [
    "LoadSpec",
    "add_arguments",
    "arrivals",
    "cpu_cores",
    "format_report",
    "input_rows",
    "percentiles",
    "plot",
    "run_command",
    "run_load",
    "targets",
    "worker_view",
]
