"""The load test's command line: its options, read once into ``Options``, and the run.

``python -m tools.bench`` (``__main__``) builds its parser with ``add_arguments`` and calls
``run_command``, which checks the options, starts a private redis-server unless told to use
another Redis, runs ``Bench`` in a temporary directory, prints the table and writes ``--json``
and ``--plot``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import tempfile
import tomllib
from pathlib import Path

import redis

from producer.cli import argtypes
from producer.jobs.job import UsageError
from producer.protocol import keys
from producer.protocol.errors import ConnectionFailed
from producer.redisio.connection import redact_url
from tools.bench.laneopts import add_lanes_arguments, lanes_options
from tools.bench.load import CALLERS
from tools.bench.pipelines import IMAGE_CONFIG
from tools.bench.processes import private_cluster, private_redis
from tools.bench.report import format_report, plot, pyplot, write_json
from tools.bench.runner import Bench, Options
from tools.bench.scenarios import SCENARIOS

BINDINGS = ("off", "io_binding", "cuda_graph")  # the workers' [model.cuda] keys, or neither

__all__ = ["BENCH_MODELS", "PROVIDERS", "SYNTHETIC_MODELS", "add_arguments", "run_command"]

HELP = """\
Load-test redbatch workers and set every figure against its ceiling, measured in the same run:
throughput, end-to-end latency percentiles (p50, p90, p99, p99.9), the batch-rows histogram,
where each request's time goes on the worker (from its /metrics histograms), bare
session.run rows/s at the same batch sizes, the Redis protocol alone, and an in-process asyncio
batcher. Prints a table; --json writes the full report, --plot a latency-throughput chart.

By default the bench starts a private redis-server on a free loopback port and its own workers
(python -m worker) with synthetic models; with --redis-url it starts them on that Redis instead;
with --no-start it drives the workers already serving --model there (REDIS_URL or the top-level
--redis-url count only then, so a bench never floods a shared Redis by accident).

scenarios (--scenario NAME[,NAME], or all; each fixed so runs compare):
{scenarios}

Without --scenario it runs a custom load: --model with --concurrency (closed loop) and/or
--rate (open loop, --arrivals poisson or bursty); several values make a sweep for --plot.

examples:
  python -m tools.bench --scenario all --json docs/bench.json --plot docs/latency-throughput.png
  python -m tools.bench --scenario all --quiet-s 60      # on a shared host: wait for idle cores
  python -m tools.bench --scenario tiny-closed,heavy-closed --rounds 5   # ratios robust to drift
  python -m tools.bench --scenario heavy-closed --duration-s 5
  python -m tools.bench --scenario lanes-backlog,lanes-tenants --no-ceilings --quiet-s 30
  python -m tools.bench --model tiny --concurrency 1,4,16,64 --plot tiny.png
  python -m tools.bench --model resnet18 --providers cuda,cpu --concurrency 1,16,64   # on a GPU
  python -m tools.bench --model heavy --rate 1000,2000,4000 --arrivals bursty --burst-size 8
  python -m tools.bench --cluster --shards 3 --model tiny --concurrency 64 --no-ceilings
  python -m tools.bench --no-start --redis-url redis://127.0.0.1:6379/0 --model demo \\
      --concurrency 64 --metrics-url http://127.0.0.1:9100/metrics
"""


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,8,64")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers") from None
    if not values or not min(values) > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers, e.g. 500,1000")
    return values


def _replica_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= 4:
        raise argparse.ArgumentTypeError(f"{value}: give 0 to 4 replicas per master")
    return value


def _scenario_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("all",):
        return tuple(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(unknown) or text!r}; "
            f"choose from {', '.join(SCENARIOS)} or all"
        )
    return names


#: The worker's provider names (``worker.config.PROVIDERS``; the producer does not import it).
PROVIDERS = ("cpu", "cuda", "tensorrt")

#: The models ``benchkit build`` can write (``tools.synthetic.BUILDERS``; the producer does not
#: import the worker, and tests check the two agree): an unknown name is a usage error here, up
#: front, not a traceback from the child process that builds it.
SYNTHETIC_MODELS = (
    "demo",
    "tiny",
    "heavy",
    "resnet18",
    "slow",
    "multi_io",
    "gather",
    "free_dim",
    "fixed_batch",
    "no_batch_output",
)


#: Models only the bench builds (``tools.benchkit.BENCH_BUILDERS``, tests check they agree):
#: image150k takes a 147 KiB row, an encoded image's size, and computes next to nothing, so
#: what it measures is Redis carrying the bytes.
BENCH_MODELS = ("image150k",)


def _provider_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give providers in order of preference, each once, from "
            f"{', '.join(PROVIDERS)} (e.g. cuda,cpu)"
        )
    return names


_MAX_S = 3600.0  # an hour: longer than any phase or reply wait worth measuring


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _seconds(text: str) -> float:
    """A measured window or a reply wait: a zero one would measure nothing (or wait for
    nothing), so the message names the open bound."""
    value = _number(text)
    if not 0 < value <= _MAX_S:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 and <= {_MAX_S:g} seconds")
    return value


def _warmup_seconds(text: str) -> float:
    """The load before the window: 0 skips it (the workers warm their sessions up anyway)."""
    value = _number(text)
    if not 0 <= value <= _MAX_S:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0 and <= {_MAX_S:g} seconds")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``python -m tools.bench`` options, and its help."""
    parser.description = HELP.format(
        scenarios="\n".join(f"  {name:<14} {s.about}" for name, s in SCENARIOS.items())
    )
    add = parser.add_argument
    add("--scenario", type=_scenario_list, metavar="NAME", help="preset(s) to run, or all")
    add("--duration-s", type=_seconds, default=3.0, metavar="S", help="measured (default 3)")
    add(
        "--warmup-s",
        type=_warmup_seconds,
        default=0.5,
        metavar="S",
        help="load before (default 0.5; 0 skips it)",
    )
    add("--json", metavar="PATH", help="write the full report as JSON")
    add("--plot", metavar="PATH", help="draw p50 and p99 against throughput (needs matplotlib)")
    add(
        "--model",
        default="tiny",
        metavar="NAME",
        help="custom load: the synthetic model the started workers serve (tiny, heavy, "
        "resnet18, demo, image150k: 147 KiB requests, ...; default tiny), or with --no-start "
        "the model the live workers serve, by any name",
    )
    add("--concurrency", type=_int_list, metavar="C[,C]", help="closed-loop callers")
    add("--rate", type=_float_list, metavar="R[,R]", help="open-loop requests/s")
    add("--arrivals", choices=("poisson", "bursty"), default="poisson", help="open-loop kind")
    add(
        "--burst-size",
        type=argtypes.positive_int,
        default=16,
        metavar="N",
        help="requests per burst",
    )
    add(
        "--max-batch-size",
        type=argtypes.positive_int,
        default=32,
        metavar="N",
        help="started workers",
    )
    add(
        "--max-wait-ms",
        type=argtypes.non_negative_float,
        default=5.0,
        metavar="MS",
        help="started workers",
    )
    add(
        "--providers",
        type=_provider_list,
        default=("cpu",),
        metavar="P[,P]",
        help="execution providers, in order, of the started workers and of the bare session.run "
        "and asyncio ceilings, so that they compare like with like: cpu, cuda, tensorrt "
        "(default cpu; e.g. cuda,cpu on a GPU machine)",
    )
    add(
        "--binding",
        choices=BINDINGS,
        default="off",
        help="started workers' [model.cuda] setting: io_binding (preallocated GPU buffers per "
        "batch shape) or cuda_graph (one CUDA graph per batch bucket); needs cuda in "
        "--providers. The bare and asyncio ceilings stay plain session.run (default off)",
    )
    add(
        "--intra-op-threads",
        type=argtypes.positive_int,
        default=0,
        metavar="N",
        help="started workers' [model] intra_op_threads (default 0: one per core); 1 leaves the "
        "other cores to Redis, the callers and the worker's own threads on a small box",
    )
    add(
        "--producers", type=argtypes.positive_int, default=1, metavar="N", help="producer processes"
    )
    add("--timeout-s", type=_seconds, default=30.0, metavar="S", help="per reply (default 30)")
    add(
        "--drain-requests",
        type=argtypes.positive_int,
        default=100_000,
        metavar="N",
        help="drain backlog",
    )
    add_lanes_arguments(parser)
    add("--no-ceilings", action="store_true", help="skip the bare and protocol ceilings")
    add(
        "--rounds",
        type=argtypes.positive_int,
        default=0,
        metavar="N",
        help="then measure each ratio target of tiny-closed, heavy-closed and pipeline N more "
        "times, its "
        "ceiling and its phase back to back, and judge it by the median ratio: on a machine "
        "whose speed drifts, a ceiling measured minutes before its phase can be off by a third",
    )
    add(
        "--quiet-s",
        type=argtypes.non_negative_float,
        default=0.0,
        metavar="S",
        help="before each measurement, wait up to S s for the machine to be idle (shared hosts)",
    )
    add(
        "--redis-url",
        dest="bench_redis_url",
        metavar="URL",
        help="start the workers on this Redis (default: a private redis-server)",
    )
    add("--no-start", action="store_true", help="drive the workers serving --model there")
    add(
        "--cluster",
        action="store_true",
        help="custom load: start a private Redis Cluster on loopback (3 masters, or one per "
        "shard, each with a replica) instead of a single redis-server, and report Redis CPU per "
        "request by master",
    )
    add(
        "--shards",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="custom load: spread --model over N shards (P:{M}:shards), with --cluster each on "
        "its own master; the started worker serves them all (default 1)",
    )
    add(
        "--replicas",
        type=_replica_count,
        default=1,
        metavar="N",
        help="with --cluster: replicas per master (default 1; they apply the writes on the same "
        "cores, and their CPU is reported apart)",
    )
    add(
        "--metrics-url",
        action="append",
        default=[],
        metavar="URL",
        help="with --no-start: a worker's /metrics (repeat for several)",
    )
    add("--model-file", metavar="PATH", help="with --no-start: the .onnx, for bare ceilings")
    add(
        "--prefix",
        default=argparse.SUPPRESS,
        help=f"with --no-start: the workers' key prefix (default {keys.DEFAULT_PREFIX})",
    )


def _check_model(model: str, no_start: bool) -> None:
    """A custom load's --model: live workers may serve any valid name, but a started worker
    serves a synthetic model the bench builds first, so only those names can be started."""
    if no_start:
        if not keys.is_valid_model_name(model):
            raise UsageError(f"--model {model!r} is not a model name.")
    elif model not in SYNTHETIC_MODELS + BENCH_MODELS:
        raise UsageError(
            f"--model {model!r} is not a synthetic model the bench can build; choose from "
            f"{', '.join(SYNTHETIC_MODELS + BENCH_MODELS)} (or drive live workers serving it "
            "with --no-start)."
        )


def _check_example_model() -> None:
    """The pipeline preset serves the image example's trained model, fetched apart: say so
    before a long run, not at its end."""
    config = tomllib.loads(IMAGE_CONFIG.read_text(encoding="utf-8"))
    if not (IMAGE_CONFIG.parent / config["model"]["path"]).is_file():
        raise UsageError(
            "the pipeline scenario serves the image example's model, which is not fetched yet: "
            "run python scripts/fetch_models.py image (or leave out the pipeline scenario)."
        )


def _options(args: argparse.Namespace) -> Options:
    scenarios = tuple(args.scenario or ())
    custom = bool(args.concurrency or args.rate)
    if scenarios and custom:
        raise UsageError("--scenario runs fixed presets; leave out --concurrency and --rate.")
    if args.no_start and scenarios:
        raise UsageError(
            "--no-start drives live workers with --concurrency or --rate; the presets start "
            "their own workers with fixed settings."
        )
    if not args.no_start and (args.metrics_url or args.model_file):
        raise UsageError("--metrics-url and --model-file go with --no-start.")
    if not scenarios:
        _check_model(args.model, args.no_start)
    if "pipeline" in scenarios:
        _check_example_model()
    if (args.cluster or args.shards > 1) and (scenarios or args.no_start):
        raise UsageError(
            "--cluster and --shards go with a custom load the bench starts (--concurrency or "
            "--rate); --no-start spreads over the shards P:{M}:shards lists already."
        )
    if args.replicas != 1 and not args.cluster:
        raise UsageError("--replicas sizes the private cluster: it goes with --cluster.")
    if args.cluster and args.bench_redis_url:
        raise UsageError("--cluster starts a private cluster; leave out --redis-url.")
    if args.binding != "off" and "cuda" not in args.providers:
        raise UsageError(f"--binding {args.binding} is a CUDA setting: add cuda to --providers.")
    if args.rounds:
        paired = [name for name in scenarios if SCENARIOS[name].paired]
        if not paired or args.no_ceilings:
            with_pairs = ", ".join(name for name, s in SCENARIOS.items() if s.paired)
            raise UsageError(
                f"--rounds measures ceilings again: give --scenario with {with_pairs} "
                "(or all), without --no-ceilings."
            )
    return Options(
        scenarios=scenarios,
        duration_s=args.duration_s,
        warmup_s=args.warmup_s,
        producers=args.producers,
        timeout_s=args.timeout_s,
        drain_requests=args.drain_requests,
        max_wait_ms=args.max_wait_ms,
        model=args.model,
        concurrency=args.concurrency or (() if args.rate else (CALLERS,)),
        rates=args.rate or (),
        arrivals=args.arrivals,
        burst_size=args.burst_size,
        max_batch_size=args.max_batch_size,
        ceilings=not args.no_ceilings,
        no_start=args.no_start,
        metrics_urls=tuple(args.metrics_url),
        model_file=args.model_file,
        prefix=getattr(args, "prefix", keys.DEFAULT_PREFIX),
        quiet_s=args.quiet_s,
        providers=args.providers,
        binding=args.binding,
        intra_op_threads=args.intra_op_threads,
        rounds=args.rounds,
        shards=args.shards,
        cluster=args.cluster,
        replicas=args.replicas,
        **lanes_options(args),
    )


def _check_worker_side(options: Options) -> None:
    """Started workers and the ceilings run in child processes that need the worker's packages,
    which a producer-only install lacks: say so before the run, not as a child's traceback."""
    needed = [] if options.no_start else ["onnxruntime", "onnx"]
    if options.ceilings and options.no_start:
        needed.append("onnxruntime")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"this bench needs {' and '.join(missing)}, which this install lacks: install "
            "'redbatch[demo]' (the worker's runtime and onnx), or drive live workers with "
            "--no-start --no-ceilings."
        )


def run_command(args: argparse.Namespace) -> int:
    """``python -m tools.bench``: run, print the table, write --json and --plot; returns 0."""
    options = _options(args)
    _check_worker_side(options)
    for path in (args.json, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"directory for {path!r} does not exist.")
    if args.plot:
        pyplot()  # fail before a long run, not after it
    with contextlib.ExitStack() as stack:
        if options.no_start:
            url = args.bench_redis_url or args.redis_url
        elif args.bench_redis_url:
            url = args.bench_redis_url
        elif options.cluster:
            masters = max(3, options.shards)
            url = stack.enter_context(private_cluster(masters, options.replicas))
        else:
            url = stack.enter_context(private_redis())
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="redbatch-bench-")))
        try:
            report = Bench(options, url, workdir).run()
        except redis.ConnectionError as exc:  # a --redis-url that does not answer
            raise ConnectionFailed(f"could not talk to Redis at {redact_url(url)}: {exc}") from exc
    print(format_report(report))
    if args.json:
        write_json(report, Path(args.json))
    if args.plot:
        plot(report, Path(args.plot))
    return 0
