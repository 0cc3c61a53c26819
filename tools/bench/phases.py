"""The measuring half of a bench run: its settings, its workers, its ceilings and its phases.

A phase is one load against one worker configuration: ``warmup_s`` of load, then ``duration_s``
measured, with the worker's /metrics and every process's CPU sampled at the window's edges.
``Workers`` keeps a started worker while the next phase wants the same setup, since starting one
takes seconds. The scenarios (``scenarios.py``, ``drain.py``) drive a ``Phases``; the order of a
whole run is ``runner.Bench``'s.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from producer.protocol import keys
from producer.redisio.connection import redact_url
from tools.bench import provenance
from tools.bench.errors import BenchError
from tools.bench.load import CALLERS, LoadSpec, run_load
from tools.bench.metrics import (
    cpu_cores,
    cpu_sample,
    machine_busy_s,
    outside_ms,
    pipeline_view,
    redis_per_request,
    scrape,
    worker_view,
)
from tools.bench.processes import (
    PREFIX,
    WorkerProcess,
    WorkerSetup,
    benchkit,
    flags,
    request_inputs,
    run_json,
)
from tools.bench.report import say
from tools.bench.shards import RedisNodes, live_shards, per_master, place_shards, write_shards

__all__ = ["HOOKS", "Options", "Phases", "Workers"]

HOOKS = "tools.bench.hooks"  # a pipeline's preprocessing alone, run as a process
_QUIET_CORES = 0.25  # --quiet-s: busier than this, and someone else is using the machine
_CPU_USERS = ("worker", "redis", "producers")  # the processes a request costs CPU in


@dataclass(frozen=True, slots=True)
class Options:
    """A run's settings, read once from the command line."""

    scenarios: tuple[str, ...] = ()
    duration_s: float = 3.0
    warmup_s: float = 0.5
    producers: int = 1
    timeout_s: float = 30.0
    drain_requests: int = 100_000
    max_wait_ms: float = 5.0
    model: str = "tiny"
    concurrency: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()
    arrivals: str = "poisson"
    burst_size: int = 16
    max_batch_size: int = 32
    ceilings: bool = True
    no_start: bool = False
    metrics_urls: tuple[str, ...] = ()
    model_file: str | None = None
    prefix: str = keys.DEFAULT_PREFIX
    quiet_s: float = 0.0
    providers: tuple[str, ...] = ("cpu",)  # the workers' and the bare and asyncio ceilings'
    binding: str = "off"  # the workers' [model.cuda] io_binding / cuda_graph; ceilings unbound
    intra_op_threads: int = 0  # the workers' [model] intra_op_threads (0: the runtime's default)
    rounds: int = 0  # times each ratio target's ceiling and phase are measured again, paired
    shards: int = 1  # the custom load's model: shards placed on distinct masters (--shards)
    cluster: bool = False  # a private local cluster instead of a single Redis (--cluster)
    replicas: int = 1  # with cluster: replicas per master (--replicas)
    lane_low_rows: int = 1_000_000  # lanes-backlog: the low backlog's rows
    lane_normal_rows: int = 100_000  # lanes-backlog: the normal backlog's rows
    lane_request_rows: int = 32  # lanes-backlog: rows per backlog request
    lane_caller_s: float = 10.0  # lanes-backlog: each window (idle, alone, with the caller)
    lane_rounds: int = 2  # lanes-backlog: pairs of windows (backlog alone, with the caller)
    tenant_rows: int = 100_000  # lanes-tenants: each tenant's backlog
    tenant_request_rows: int = 4  # lanes-tenants: rows per request
    tenant_weights: tuple[tuple[int, int], ...] = ((1, 1), (3, 1))
    min_share_s: float = 15.0  # lanes-tenants: the minimum share's window
    min_share_high_rows: int = 150_000  # lanes-tenants: the saturating high backlog
    min_share_low_rows: int = 30_000  # lanes-tenants: the low backlog beside it


class Workers:
    """At most one started worker at a time, kept while the next phase wants the same setup."""

    def __init__(
        self,
        url: str,
        workdir: Path,
        model_file: Callable[[str], Path],
        providers: Sequence[str] = ("cpu",),
        binding: str = "off",
        threads: int = 0,
    ) -> None:
        self.url, self.workdir, self.model_file = url, workdir, model_file
        self.providers = tuple(providers)
        self.binding = binding
        self.threads = threads
        self.current: WorkerProcess | None = None

    def get(self, setup: WorkerSetup) -> WorkerProcess:
        if self.current is not None and self.current.setup == setup:
            return self.current
        self.stop()
        say(f"starting a worker: {setup.model}, max_batch_size {setup.max_batch_size}")
        path = setup.model_path or self.model_file(setup.model)
        worker = WorkerProcess(
            setup, path, self.url, self.workdir, self.providers, self.binding, self.threads
        )
        self.current = worker.start()
        _say_fallback("the worker", self.providers, worker.record["runtime"]["providers"])
        return worker

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


class Phases:
    """What a scenario drives: a run's settings, its workers, the ceilings and phases it
    measures, and the report it keeps. ``runner.Bench`` adds the order a run takes."""

    def __init__(self, options: Options, url: str, workdir: Path) -> None:
        self.o = options
        self.url = url
        self.workdir = workdir
        self._models: dict[str, Path] = {}
        self.workers = Workers(
            url,
            workdir,
            self.model_file,
            options.providers,
            options.binding,
            options.intra_op_threads,
        )
        self.max_throughput: dict[WorkerSetup, float] = {}
        self._loads: dict[str, tuple[WorkerSetup, dict[str, Any]]] = {}  # phase id: its setup
        self.shard_tags: dict[str, tuple[str, ...]] = {}  # model: its shard tags, when sharded
        settings = asdict(options)
        settings["redis"] = redact_url(url)
        self.report: dict[str, Any] = {
            "redbatch_bench": 1,
            "command": provenance.command_line(),
            "started_at": provenance.utc_now(),
            "machine": provenance.machine(url),
            "source": provenance.source(),
            "settings": settings,
            "ceilings": {"bare": {}, "protocol": {}, "asyncio": {}, "preprocess": {}},
            "phases": [],
            "drain": None,
            "rounds": {},
            "targets": [],
            "redis": {"cluster": False, "nodes": [], "shards": {}},
        }

    # -- shards -----------------------------------------------------------------------------

    def shard(self, prefix: str, model: str, count: int, live: bool = False) -> tuple[str, ...]:
        """``count`` shards of ``model`` placed on distinct masters and listed in
        ``P:{M}:shards`` for the workers started next (``live``: the tags live workers' list
        names now, read instead); the loads of ``model`` are then spread over them."""
        conn = redis.Redis.from_url(self.url, socket_timeout=10)
        nodes = RedisNodes(conn)
        try:
            if live:
                tags = live_shards(nodes.topology, prefix, model)
            else:
                owner = nodes.topology.slots.node if nodes.cluster else None
                try:
                    tags = tuple(place_shards(model, count, owner))
                except ValueError as exc:
                    raise BenchError(str(exc)) from None
                write_shards(nodes.topology, prefix, model, tags)
            where = {tag: nodes.master_of(tag) for tag in tags}
            self.report["redis"] = {
                "cluster": nodes.cluster,
                "nodes": nodes.describe(),
                "shards": {**self.report["redis"]["shards"], model: where},
            }
        finally:
            nodes.close()
            conn.close()
        if len(tags) > 1 or nodes.cluster:
            say(f"shards of {model}: " + ", ".join(f"{t} on {a}" for t, a in where.items()))
        self.shard_tags[model] = tags
        return tags

    # -- models and ceilings ----------------------------------------------------------------

    def model_file(self, name: str) -> Path:
        """The synthetic model ``name``, built once per run by ``benchkit build``."""
        if name not in self._models:
            path = self.workdir / f"{name}.onnx"
            benchkit("build", name, str(path), timeout_s=300)
            self._models[name] = path
        return self._models[name]

    @property
    def _ceiling_s(self) -> float:
        return max(self.o.duration_s / 2, 0.5)

    def bare(
        self, model: str, sizes: Sequence[int], model_file: Path | None = None, keep: bool = True
    ) -> dict[str, Any]:
        """Bare ``session.run`` at ``sizes``; ``keep``: as the run's ceiling, in the report."""
        say(f"ceiling: bare session.run, {model}, batch {', '.join(map(str, sizes))}")
        path = model_file or self.model_file(model)
        argv = flags(
            model_file=path,
            batch_sizes=",".join(map(str, sizes)),
            duration_s=self._ceiling_s,
            providers=",".join(self.o.providers),
        )
        result = self._ceiling("bare", *argv, timeout_s=120 + 4 * self._ceiling_s * len(sizes))
        _say_fallback("bare session.run", self.o.providers, result["providers"])
        if not keep:
            return result
        known = self.report["ceilings"]["bare"].setdefault(model, result)
        known["batch"].update(result["batch"])
        self.report["machine"].setdefault("onnxruntime", result["onnxruntime"])
        self.report["machine"].setdefault("providers", result["providers"])
        return result

    def protocol(
        self, model: str, source: tuple[str, str], max_batch_size: int, keep: bool = True
    ) -> dict[str, Any]:
        """The Redis protocol alone, with ``model``'s request and reply sizes; ``source`` is
        ``("--model-file", PATH)`` or ``("--specs", JSON_PATH)``."""
        say(f"ceiling: Redis protocol alone, {model}-sized requests, {CALLERS} in flight")
        argv = flags(
            prefix=f"{PREFIX}-protocol",
            concurrency=CALLERS,
            max_batch_size=max_batch_size,
            producers=self.o.producers,
            duration_s=self.o.duration_s,
            warmup_s=self.o.warmup_s,
        )
        timeout_s = 180 + self.o.duration_s + self.o.timeout_s
        result = self._ceiling("protocol", *source, *argv, timeout_s=timeout_s)
        if keep:
            self.report["ceilings"]["protocol"][model] = result
        return result

    def asyncio_batcher(self, model: str, keep: bool = True) -> dict[str, Any]:
        say(f"ceiling: in-process asyncio batcher, {model}, {CALLERS} callers")
        argv = flags(
            model_file=self.model_file(model),
            callers=CALLERS,
            max_batch_size=32,
            window_ms=10,
            duration_s=self.o.duration_s,
            warmup_s=self.o.warmup_s,
            providers=",".join(self.o.providers),
        )
        result = self._ceiling("asyncio", *argv, timeout_s=120 + self.o.duration_s)
        if keep:
            self.report["ceilings"]["asyncio"][model] = result
        return result

    def preprocess_alone(
        self,
        model: str,
        pipeline: dict[str, Any],
        source_dir: Path,
        body_out: Path,
        keep: bool = True,
    ) -> dict[str, Any]:
        """A pipeline's ``preprocess`` alone on its ``threads`` threads (``tools.bench.hooks``),
        writing the request it preprocessed to ``body_out``; ``keep``: in the report."""
        threads = int(pipeline.get("threads", 1))
        say(f"ceiling: preprocessing alone, {pipeline['handler']}, {threads} threads")
        argv = flags(
            handler=pipeline["handler"],
            source_dir=source_dir,
            options=json.dumps(pipeline.get("options", {})),
            threads=threads,
            duration_s=self._ceiling_s,
            warmup_s=min(self.o.warmup_s, 0.5),
            body_out=body_out,
        )
        timeout_s = 120 + 2 * self._ceiling_s
        result = self._ceiling(*argv, timeout_s=timeout_s, module=HOOKS)
        if keep:
            self.report["ceilings"]["preprocess"][model] = result
        return result

    def _ceiling(self, *args: str, timeout_s: float, module: str | None = None) -> dict[str, Any]:
        """A ``benchkit`` measurement (or another measuring ``module``'s), with the cores it,
        Redis and anything else used."""
        self.wait_for_quiet()
        conn = redis.Redis.from_url(self.url, socket_timeout=10)
        nodes = RedisNodes(conn)  # a cluster's every server
        try:
            before = cpu_sample(conn, {}, redis_s=sum(nodes.cpu_s().values()))
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            if module is None:
                result = benchkit(*args, timeout_s=timeout_s, redis_url=self.url)
            else:
                result = run_json(module, *args, timeout_s=timeout_s, redis_url=self.url)
            after = cpu_sample(conn, {}, redis_s=sum(nodes.cpu_s().values()))
            done = resource.getrusage(resource.RUSAGE_CHILDREN)
        finally:
            nodes.close()
            conn.close()
        used_s = done.ru_utime + done.ru_stime - children.ru_utime - children.ru_stime
        after["benchkit"], before["benchkit"] = used_s, 0.0
        result["cpu_cores"] = cpu_cores(before, after)
        return result

    def wait_for_quiet(self) -> None:
        """With ``--quiet-s``: wait, at most that long, until the machine's cores are idle
        (under ``_QUIET_CORES`` busy over half a second, an idle worker included)."""
        deadline = time.monotonic() + self.o.quiet_s
        said = False
        while self.o.quiet_s:
            before = machine_busy_s()
            time.sleep(0.5)
            busy = (machine_busy_s() - before) / 0.5
            if busy < _QUIET_CORES:
                return
            if time.monotonic() > deadline:
                say(f"the machine is still busy ({busy:.2f} cores); measuring anyway")
                return
            if not said:
                say(f"waiting for the machine to go quiet ({busy:.2f} cores busy)")
                said = True

    # -- phases -----------------------------------------------------------------------------

    def phase(
        self,
        phase_id: str,
        setup: WorkerSetup,
        load: dict[str, Any],
        series: str | None = None,
        keep: bool = True,
    ) -> dict[str, Any]:
        """Run ``load`` against a started worker serving ``setup``; returns the phase.
        ``keep``: as one of the run's phases, in the report."""
        worker = self.workers.get(setup)
        self.report["machine"].setdefault("onnxruntime", worker.record["runtime"]["onnxruntime"])
        spec = self.load_spec(PREFIX, setup.served, request_inputs(worker.record), load)
        urls = [worker.metrics_url]
        phase = self._measure(phase_id, spec, setup.model, worker.record, urls, [worker.pid], keep)
        if not keep:
            return phase
        phase["series"] = series
        self._loads[phase_id] = setup, load
        if spec.mode == "closed" and spec.concurrency >= CALLERS:
            self.max_throughput[setup] = phase["throughput_per_s"]
        return phase

    def rerun(self, phase_id: str, label: str) -> dict[str, Any]:
        """Phase ``phase_id`` of this run again, its setup and load, kept out of the report."""
        setup, load = self._loads[phase_id]
        return self.phase(label, setup, load, keep=False)

    def load_spec(self, prefix: str, served: str, inputs: Any, load: dict[str, Any]) -> LoadSpec:
        o = self.o
        return LoadSpec(
            url=self.url,
            prefix=prefix,
            model=served,
            inputs=inputs,
            duration_s=o.duration_s,
            warmup_s=o.warmup_s,
            timeout_s=o.timeout_s,
            tags=self.shard_tags.get(served, ()),
            **load,
        )

    def _measure(
        self,
        phase_id: str,
        spec: LoadSpec,
        model: str,
        record: dict[str, Any],
        metrics_urls: Sequence[str],
        worker_pids: Sequence[int] = (),
        keep: bool = True,
    ) -> dict[str, Any]:
        self.wait_for_quiet()
        say(f"{phase_id}: {spec.label()} for {spec.warmup_s:g} + {spec.duration_s:g} s")
        conn = redis.Redis.from_url(self.url, socket_timeout=10)
        nodes = RedisNodes(conn)

        def probe(producer_pids: list[int]) -> tuple[Any, ...]:
            pids = {"producers": producer_pids, "worker": worker_pids}
            metrics = scrape(metrics_urls) if metrics_urls else {}
            node_cpu = nodes.cpu_s()  # every server's: a cluster's replicas too
            sample = cpu_sample(conn, pids, redis_s=sum(node_cpu.values()))
            return metrics, sample, nodes.commands(), node_cpu

        try:
            result, before, after = run_load(spec, self.o.producers, probe)
            tags = spec.tags or (spec.model,)
            where = {tag: nodes.master_of(tag) for tag in tags}
            described = nodes.describe()
        finally:
            nodes.close()
            conn.close()
        batching = record["batching"]
        phase: dict[str, Any] = {
            "id": phase_id,
            "model": model,
            "worker": {
                "max_batch_size": batching["max_batch_size"],
                "max_wait_ms": batching["max_wait_ms"],
                "providers": record.get("runtime", {}).get("providers"),
                "binding": record.get("runtime", {}).get("binding", "off"),
            },
            "load": {
                "mode": spec.mode,
                "label": spec.label(),
                "concurrency": spec.concurrency if spec.mode == "closed" else None,
                "rate_per_s": spec.rate_per_s if spec.mode != "closed" else None,
                "burst_size": spec.burst_size if spec.mode == "bursty" else None,
                "producers": self.o.producers,
                "duration_s": spec.duration_s,
                "warmup_s": spec.warmup_s,
            },
            **result.summary(),
            "worker_side": worker_view(before[0], after[0]) if metrics_urls else None,
            "cpu_cores": cpu_cores(before[1], after[1]),
        }
        seconds = after[1]["t"] - before[1]["t"]
        answered = round(phase["throughput_per_s"] * seconds)
        phase["redis_commands"] = redis_per_request(before[2], after[2], answered)
        by_shard = result.shard_completed()
        phase["redis_cpu"] = per_master(described, where, before[3], after[3], seconds, by_shard)
        phase["vs_ceiling"] = self._ratios(phase)
        phase["cpu_budget"] = self._cpu_budget(phase)
        if phase["worker_side"] is not None:
            phase["worker_side"]["outside_ms"] = outside_ms(phase)
            if record.get("pipeline"):
                cores = self.report["machine"]["cpus_usable"]
                phase["pipeline"] = pipeline_view(before[0], after[0], record, seconds, cores)
        if keep:
            self.report["phases"].append(phase)
        lat = phase["latency_ms"]
        say(
            f"{phase_id}: {phase['throughput_per_s']:,.0f} req/s, p50 {lat.get('p50', 0):.1f} ms, "
            f"p99 {lat.get('p99', 0):.1f} ms, mean batch {phase['batch_rows']['mean']:.1f}"
        )
        if phase["lost"]:
            say(f"{phase_id}: {phase['lost']} requests got no reply within {spec.timeout_s:g} s")
        return phase

    def _ratios(self, phase: dict[str, Any]) -> dict[str, float]:
        ceilings = self.report["ceilings"]
        throughput = phase["throughput_per_s"]
        bare = ceilings["bare"].get(phase["model"], {}).get("batch", {})
        ratios = {}
        at_max = bare.get(str(phase["worker"]["max_batch_size"]))
        if at_max:
            ratios["throughput_over_bare"] = throughput / at_max["rows_per_s"]
        if bare.get("1") and phase["latency_ms"]:
            ratios["p50_over_bare_batch1"] = phase["latency_ms"]["p50"] / bare["1"]["run_ms"]["p50"]
        protocol = ceilings["protocol"].get(phase["model"])
        if protocol and protocol["throughput_per_s"]:
            ratios["throughput_over_protocol"] = throughput / protocol["throughput_per_s"]
        return ratios

    def _cpu_budget(self, phase: dict[str, Any]) -> dict[str, float] | None:
        """CPU ms per request by process, and the throughput the machine's cores would allow
        if every one were busy with that same work: what the worker could reach at best here.

        The model's share is bare ``session.run``'s CPU per row at the worker's max_batch_size
        (its best case); the worker's other CPU is the rest of its process. Only for phases
        served on the CPU: on a GPU the cores do not bound the model.
        """
        bare = self.report["ceilings"]["bare"].get(phase["model"], {})
        at_max = bare.get("batch", {}).get(str(phase["worker"]["max_batch_size"]), {})
        cores, throughput = phase.get("cpu_cores") or {}, phase["throughput_per_s"]
        served = phase["worker"].get("providers") or []
        if "cpu_ms_per_row" not in at_max or not throughput or served != [_ORT_NAMES["cpu"]]:
            return None
        if not cores.get("worker"):  # --no-start: the workers' processes are not ours to read
            return None
        per_request = {k: 1000.0 * cores.get(k, 0.0) / throughput for k in _CPU_USERS}
        model = at_max["cpu_ms_per_row"]
        budget = {
            "model_ms": model,
            "worker_other_ms": max(per_request["worker"] - model, 0.0),
            "redis_ms": per_request["redis"],
            "producers_ms": per_request["producers"],
        }
        total = sum(budget.values())
        budget["total_ms"] = total
        budget["bound_per_s"] = 1000.0 * self.report["machine"]["cpus_usable"] / total
        budget["bound_over_bare"] = budget["bound_per_s"] / at_max["rows_per_s"]
        return budget

    def closed_max(self, setup: WorkerSetup, scenario: str) -> float:
        """The setup's throughput at ``CALLERS`` closed-loop callers, measured now if no phase
        of this run has measured it yet."""
        if setup not in self.max_throughput:
            self.phase(f"{scenario}/max", setup, {"mode": "closed", "concurrency": CALLERS})
        return self.max_throughput[setup]


#: onnxruntime's names for the providers of ``--providers`` (the worker's ``model.providers``).
_ORT_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}


def _say_fallback(what: str, requested: Sequence[str], serving: Sequence[str]) -> None:
    """One line when a session runs without a provider that was asked for (no GPU, say): the
    worker falls back to the CPU with a log line of its own, which the bench does not show."""
    missing = [p for p in requested if _ORT_NAMES.get(p, p) not in serving]
    if missing:
        say(f"{what} runs without {', '.join(missing)}: serving with {', '.join(serving)}")
