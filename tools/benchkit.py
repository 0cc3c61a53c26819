"""The ceilings ``python -m tools.bench`` compares the worker with, each printed as one JSON object.

``python -m tools.bench`` (``tools/bench/``) never imports the worker or onnxruntime, so it runs
this module as a process, ``python -m tools.benchkit COMMAND``, and reads the JSON it prints:

- ``build NAME PATH``: write a synthetic model (``tools.synthetic``).
- ``bare``: bare ``session.run`` at given batch sizes, the worker's session options and providers.
- ``protocol``: the Redis protocol alone: an echo worker (read, reply, ack and delete with the
  worker's own ``RequestStream``; no decoding, no model) driven by one pipelining producer process
  running the bench's own closed-loop driver.
- ``asyncio``: the in-process reference: an ``asyncio.Queue`` batcher with a window, callers as
  coroutines, no Redis.
- ``redis``: a private redis-server on a free loopback port, stopped when stdin closes.

Everything here is bounded in time and count; onnxruntime is imported only by the commands that
build a session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import redis

from producer.protocol.codec import ModelRef, Reply, encode_reply
from producer.protocol.keys import is_valid_rid, request_stream
from producer.redisio.topology import Topology
from tools import bench
from worker.config import PROVIDERS, ModelConfig, ProviderConfig
from worker.errors import WorkerError
from worker.redisio.stream import Finish, RawEntry, RequestStream

__all__ = ["BENCH_BUILDERS", "main", "measure_asyncio", "measure_bare", "measure_protocol"]

_MAX_RUNS = 200_000  # a bound on any measuring loop, whatever the duration
_ECHO_BLOCK_MS = 200  # how late the echo worker notices its stop flag when idle


# ---------------------------------------------------------------------------------------------
# Bare session.run


def _session(model_file: Path, providers: Sequence[str] = ("cpu",)) -> Any:
    from worker.model.session import OnnxModel

    # The worker's defaults and fallback: a provider that cannot start is left out of .providers.
    chosen = tuple(ProviderConfig(name) for name in providers)
    return OnnxModel(ModelConfig(name="bench", path=model_file.resolve(), providers=chosen))


def _io_specs(model: Any) -> dict[str, list[dict[str, Any]]]:
    """The model's inputs and outputs in the worker record's form (name, dtype, shape)."""
    return {
        "inputs": [{"name": s.name, "dtype": str(s.dtype), "shape": s.shape} for s in model.inputs],
        "outputs": [
            {"name": s.name, "dtype": str(s.dtype), "shape": s.shape} for s in model.outputs
        ],
    }


def measure_bare(
    model_file: Path,
    batch_sizes: Sequence[int],
    duration_s: float,
    providers: Sequence[str] = ("cpu",),
) -> dict[str, Any]:
    """Rows per second and run times of bare ``session.run`` at each batch size."""
    model = _session(model_file, providers)
    specs = _io_specs(model)
    names = [o["name"] for o in specs["outputs"]]
    batches: dict[str, Any] = {}
    for size in batch_sizes:
        feeds = bench.input_rows(specs["inputs"], size, 0)
        for _ in range(3):
            model.run(feeds, names)
        times_s: list[float] = []
        end = time.monotonic() + duration_s
        cpu0 = time.process_time()  # every thread of this process: onnxruntime's pool too
        while len(times_s) < _MAX_RUNS and (len(times_s) < 5 or time.monotonic() < end):
            t0 = time.perf_counter()
            model.run(feeds, names)
            times_s.append(time.perf_counter() - t0)
        cpu_s = time.process_time() - cpu0
        total_s = sum(times_s)
        batches[str(size)] = {
            "runs": len(times_s),
            "rows_per_s": size * len(times_s) / total_s,
            "cpu_ms_per_row": 1000.0 * cpu_s / (size * len(times_s)),
            "run_ms": {
                "mean": 1000.0 * total_s / len(times_s),
                "p50": 1000.0 * float(np.percentile(times_s, 50)),
                "p99": 1000.0 * float(np.percentile(times_s, 99)),
            },
        }
    return {
        "model_file": str(model_file),
        "onnxruntime": model.runtime_version,
        "providers": model.providers,
        "requested_providers": model.requested,
        "batch": batches,
    }


# ---------------------------------------------------------------------------------------------
# The Redis protocol alone


class _EchoReplies:
    """One encoded reply per batch size, zeros of the model's output shapes (one row each)."""

    def __init__(self, outputs: Sequence[dict[str, Any]]) -> None:
        self._outputs = bench.input_rows(outputs, 1, 0)
        self._cache: dict[int, bytes] = {}

    def __call__(self, batch_rows: int) -> bytes:
        reply = self._cache.get(batch_rows)
        if reply is None:
            # The client takes the rid from the key it popped, so one body serves every rid.
            reply = encode_reply(
                Reply(
                    rid="echo",
                    ok=True,
                    model=ModelRef("echo", "1", "0" * 64),
                    worker="echo",
                    timings_ms={"queued": 0.0, "inference": 0.0},
                    outputs={k: np.zeros_like(v) for k, v in self._outputs.items()},
                    batch_rows=batch_rows,
                )
            )
            self._cache[batch_rows] = reply
        return reply


class _Echo(threading.Thread):
    """Reads up to ``count`` entries, answers each with a canned reply, acks and deletes them,
    until stopped; ``failure`` holds what stopped it otherwise."""

    def __init__(self, stream: RequestStream, replies: _EchoReplies, count: int) -> None:
        super().__init__(name="echo", daemon=True)
        self.stream, self.replies, self.count = stream, replies, count
        self.stop = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                entries = self.stream.read(self.count, _ECHO_BLOCK_MS)
                if entries:
                    reply = self.replies(len(entries))
                    finishes = [Finish(e.entry_id, _rid(e), reply, 600) for e in entries]
                    self.stream.finish(finishes)
        except BaseException as exc:  # raised on the measuring thread once the load is over
            self.failure = exc


def _rid(entry: RawEntry) -> str:
    """The entry's rid, checked as intake checks it: only checked names go into keys."""
    rid = entry.fields[b"rid"].decode()
    if not is_valid_rid(rid):
        raise ValueError(f"the bench's producer sent an invalid rid {rid[:140]!r}")
    return rid


def measure_protocol(
    redis_url: str,
    specs: dict[str, list[dict[str, Any]]],
    *,
    prefix: str,
    concurrency: int,
    max_batch_size: int,
    duration_s: float,
    warmup_s: float,
    producers: int = 1,
) -> dict[str, Any]:
    """Requests per second through the protocol alone: this process echoes, producers drive."""
    model = "protocol-echo"
    client = redis.Redis.from_url(redis_url, socket_timeout=30)
    topology = Topology(client)  # on a cluster, the echo's stream lives on its slot's master
    topology.refresh()
    shard = topology.client(model)
    stream = RequestStream(shard, prefix, model, "echo")
    stream.ensure_group()
    echo = _Echo(stream, _EchoReplies(specs["outputs"]), max_batch_size)
    echo.start()
    load = bench.LoadSpec(
        url=redis_url,
        prefix=prefix,
        model=model,
        inputs=specs["inputs"],
        mode="closed",
        concurrency=concurrency,
        duration_s=duration_s,
        warmup_s=warmup_s,
    )
    try:
        result, _, _ = bench.run_load(load, producers)
    finally:
        echo.stop.set()
        echo.join(timeout=5)
        shard.delete(request_stream(prefix, model))
        topology.close()
        client.close()
    if echo.failure is not None:
        raise RuntimeError(f"the echo worker failed: {echo.failure!r}") from echo.failure
    summary = result.summary()
    summary["max_batch_size"] = max_batch_size
    return summary


# ---------------------------------------------------------------------------------------------
# The in-process asyncio batcher (the reference)


async def _asyncio_run(
    model: Any,
    specs: dict[str, list[dict[str, Any]]],
    callers: int,
    max_batch_size: int,
    window_ms: float,
    duration_s: float,
    warmup_s: float,
) -> dict[str, Any]:
    names = [o["name"] for o in specs["outputs"]]
    row = bench.input_rows(specs["inputs"], 1, 0)
    queue: asyncio.Queue[tuple[dict[str, np.ndarray], asyncio.Future[Any]]] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    w0, w1 = t0 + warmup_s, t0 + warmup_s + duration_s
    latencies_ms: list[float] = []
    batch_rows: list[int] = []

    async def batcher() -> None:
        while True:
            items = [await queue.get()]
            deadline = loop.time() + window_ms / 1000.0
            while len(items) < max_batch_size:
                if not queue.empty():
                    items.append(queue.get_nowait())
                    continue
                left_s = deadline - loop.time()
                if left_s <= 0:
                    break
                # Not wait_for: on 3.11 it can drop an item that arrives as the timeout fires.
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter}, timeout=left_s)
                if getter not in done:
                    getter.cancel()  # a cancelled get leaves its item in the queue
                    break
                items.append(getter.result())
            feeds = {k: np.concatenate([i[0][k] for i in items]) for k in row}
            outputs = model.run(feeds, names)  # inline, as a simple in-process batcher does
            for n, (_, future) in enumerate(items):
                future.set_result(([o[n : n + 1] for o in outputs], len(items)))

    async def caller() -> None:
        while (sent := loop.time()) < w1:
            future: asyncio.Future[Any] = loop.create_future()
            queue.put_nowait((row, future))
            _, rows = await future
            if sent >= w0:
                latencies_ms.append((loop.time() - sent) * 1000.0)
                batch_rows.append(rows)

    task = asyncio.create_task(batcher())
    await asyncio.gather(*(caller() for _ in range(callers)))
    task.cancel()
    return {
        "callers": callers,
        "max_batch_size": max_batch_size,
        "window_ms": window_ms,
        "requests": len(latencies_ms),
        "throughput_per_s": len(latencies_ms) / duration_s,
        "latency_ms": bench.percentiles(latencies_ms),
        "mean_batch_rows": float(np.mean(batch_rows)) if batch_rows else 0.0,
        "providers": model.providers,
    }


def measure_asyncio(
    model_file: Path,
    *,
    callers: int,
    max_batch_size: int,
    window_ms: float,
    duration_s: float,
    warmup_s: float,
    providers: Sequence[str] = ("cpu",),
) -> dict[str, Any]:
    """Requests per second of ``callers`` coroutines sharing one in-process asyncio batcher."""
    model = _session(model_file, providers)
    specs = _io_specs(model)
    return asyncio.run(
        _asyncio_run(model, specs, callers, max_batch_size, window_ms, duration_s, warmup_s)
    )


# ---------------------------------------------------------------------------------------------
# Commands


def image150k() -> Any:
    """``x`` float32 [N, 37632] (147 KiB a row, the size of an encoded image) -> its mean,
    [N, 1]: next to nothing to compute, so the worker and Redis carry the bytes."""
    import onnx

    helper, f32 = onnx.helper, onnx.TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=1)],
        "redbatch",
        [helper.make_tensor_value_info("x", f32, ["N", 37632])],
        [helper.make_tensor_value_info("y", f32, ["N", 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9  # as tools.synthetic's: readable by every onnxruntime >= 1.16
    onnx.checker.check_model(model)
    return model


#: Models only the bench builds, next to ``tools.synthetic.BUILDERS`` (the bench's
#: ``cli.BENCH_MODELS`` names them on the producer side, which never imports onnx).
BENCH_BUILDERS = {"image150k": image150k}


def _cmd_build(args: argparse.Namespace) -> dict[str, Any]:
    from tools.synthetic import save
    from worker.model.session import read_model_file

    if args.name in BENCH_BUILDERS:
        path = Path(args.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(BENCH_BUILDERS[args.name]().SerializeToString())
    else:
        path = save(args.name, args.path)
    return {"model": args.name, "path": str(path), "sha256": read_model_file(path).sha256}


def _cmd_bare(args: argparse.Namespace) -> dict[str, Any]:
    return measure_bare(Path(args.model_file), args.batch_sizes, args.duration_s, args.providers)


def _cmd_protocol(args: argparse.Namespace) -> dict[str, Any]:
    if not args.redis_url:
        raise SystemExit("protocol needs --redis-url or REDIS_URL")
    if args.specs:
        specs = json.loads(Path(args.specs).read_text(encoding="utf-8"))
    else:
        specs = _io_specs(_session(Path(args.model_file)))
    return measure_protocol(
        args.redis_url,
        specs,
        prefix=args.prefix,
        concurrency=args.concurrency,
        max_batch_size=args.max_batch_size,
        duration_s=args.duration_s,
        warmup_s=args.warmup_s,
        producers=args.producers,
    )


def _cmd_asyncio(args: argparse.Namespace) -> dict[str, Any]:
    return measure_asyncio(
        Path(args.model_file),
        callers=args.callers,
        max_batch_size=args.max_batch_size,
        window_ms=args.window_ms,
        duration_s=args.duration_s,
        warmup_s=args.warmup_s,
        providers=args.providers,
    )


def _cmd_redis(args: argparse.Namespace) -> dict[str, Any] | None:
    from tools.localredis import LocalRedis

    def stop(*_: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    with LocalRedis() as server:
        print(json.dumps({"url": server.url}), flush=True)
        sys.stdin.read()  # until the bench closes our stdin (or exits)
    return None


_EPILOG = """\
examples:
  python -m tools.benchkit build heavy /tmp/heavy.onnx
  python -m tools.benchkit bare --model-file /tmp/heavy.onnx --batch-sizes 1,32 --duration-s 2
  python -m tools.benchkit bare --model-file /tmp/resnet18.onnx --providers cuda,cpu
  python -m tools.benchkit protocol --redis-url redis://127.0.0.1:6379/0 \\
      --model-file /tmp/tiny.onnx --concurrency 64 --duration-s 3
  python -m tools.benchkit asyncio --model-file /tmp/heavy.onnx --callers 64 --window-ms 10
  python -m tools.benchkit redis        # prints {"url": ...}; stops when stdin closes

Each command prints one JSON object on stdout. 'python -m tools.bench' runs these for its ceilings.
"""


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,32")
    return sizes


def _providers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - PROVIDERS.keys():
        raise argparse.ArgumentTypeError(f"{text!r}: give some of {', '.join(PROVIDERS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m tools.benchkit`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.benchkit",
        description="Ceilings for 'python -m tools.bench': bare session.run, the Redis protocol "
        "alone, and an in-process asyncio batcher. Prints JSON.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    build = commands.add_parser("build", help="write a synthetic model", epilog=_EPILOG)
    build.add_argument("name", help="model builder: tiny, heavy, demo, slow, ...")
    build.add_argument("path", help="where to write the .onnx file")
    build.set_defaults(handler=_cmd_build)

    def timing(p: argparse.ArgumentParser, *, warmup: bool = True) -> None:
        p.add_argument("--duration-s", type=float, default=3.0, help="seconds measured")
        if warmup:
            p.add_argument("--warmup-s", type=float, default=0.5, help="seconds before measuring")

    def session(p: argparse.ArgumentParser) -> None:  # the commands that run the model
        p.add_argument("--model-file", required=True, help="the .onnx file")
        p.add_argument("--providers", type=_providers, default=["cpu"], help="e.g. cuda,cpu")

    bare = commands.add_parser("bare", help="bare session.run rows/s", epilog=_EPILOG)
    session(bare)
    bare.add_argument("--batch-sizes", type=_sizes, default=[1, 32], help="e.g. 1,32")
    timing(bare, warmup=False)  # three unmeasured runs per batch size instead
    bare.set_defaults(handler=_cmd_bare)

    proto = commands.add_parser("protocol", help="Redis protocol alone req/s", epilog=_EPILOG)
    proto.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="the Redis to measure (default: $REDIS_URL)",
    )
    source = proto.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-file", help="take request and reply shapes from this model")
    source.add_argument("--specs", help="or from a JSON file {inputs: [...], outputs: [...]}")
    proto.add_argument("--prefix", default="rbbench", help="key prefix (default rbbench)")
    proto.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    proto.add_argument("--max-batch-size", type=int, default=32, help="entries per read")
    proto.add_argument("--producers", type=int, default=1, help="producer processes")
    timing(proto)
    proto.set_defaults(handler=_cmd_protocol)

    aio = commands.add_parser("asyncio", help="in-process asyncio batcher", epilog=_EPILOG)
    session(aio)
    aio.add_argument("--callers", type=int, default=64, help="caller coroutines")
    aio.add_argument("--max-batch-size", type=int, default=32, help="rows per batch")
    aio.add_argument("--window-ms", type=float, default=10.0, help="batch window")
    timing(aio)
    aio.set_defaults(handler=_cmd_asyncio)

    red = commands.add_parser("redis", help="a private redis-server", epilog=_EPILOG)
    red.set_defaults(handler=_cmd_redis)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.handler(args)
    except WorkerError as exc:  # a missing package, a model that does not load: one line
        print(f"benchkit: error: {exc}", file=sys.stderr)
        return 2
    if result is not None:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
