#!/usr/bin/env python3
"""Run the fault-injection suite's full tier and write docs/reliability.md.

The scenarios live in tests/chaos/ and are the ones the fast tier (tests/test_faults.py) runs,
here at full size: 10 SIGKILLs among 4 workers over 2,000+ requests, kills at each fault point,
Redis killed and restarted with AOF always and everysec, CLIENT KILL every second, FLUSHALL
mid-run, a crash pill, batches slower than claim_idle_ms, SIGTERM mid-batch, a Redis filled to
maxmemory while the workers are stopped, producers at full speed against a small maxmemory, and
100,000 fuzzed requests (tests/fuzzing), and the hostile producers and refusing Redis of
scripts/reliability_hostile.py (each the fast tier's test of that fault, in its own process).
Each scenario's oracle verdict and figures go into one table; the exit status is 1 when any
scenario failed.

Run some scenarios alone with --only (keys from --list, by spaces or commas) and write their
report elsewhere, so that docs/reliability.md stays the whole tier's:

    --only stopped_workers_fill,full_speed_small_maxmemory --out /tmp/overload.md

--cluster runs the Redis Cluster tier instead (scripts/reliability_cluster.py) and rewrites only
the report's "Redis Cluster" section, which a run without it keeps.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]

import chaos  # noqa: E402  (tests/ is put on the path just above)
import reliability_cluster  # noqa: E402  (and scripts/)
import reliability_hostile  # noqa: E402


@dataclass(frozen=True, slots=True)
class Step:
    """One row of the report: a scenario with its full-tier sizes, or the fuzzer."""

    key: str
    title: str
    run: Callable[[Path, int], chaos.Result]


def _steps(fuzz_n: int) -> list[Step]:
    steps = [
        Step(
            "random_kills",
            "SIGKILL at random moments: 10 kills among 4 workers, 3,000 requests",
            lambda d, seed: chaos.random_kills(
                d, requests=3000, workers=4, kills=10, duration_s=40.0, seed=seed
            ),
        ),
        Step(
            "random_kills_lanes",
            "The same across lanes: raw v2 XADDs, classes high and low, 3 classes for "
            "2 tenants (MULTI; SADD; XADD)",
            lambda d, seed: chaos.random_kills(
                d, requests=3000, workers=4, kills=10, duration_s=40.0, seed=seed, lanes=True
            ),
        ),
        Step(
            "fault_storm",
            "SIGKILL at random fault points (p = 0.01 each): 10 kills among 4 workers",
            lambda d, seed: chaos.fault_storm(
                d, requests=2000, workers=4, kills=10, probability=0.01, duration_s=20.0, seed=seed
            ),
        ),
    ]
    steps += [
        Step(
            f"kill_{point}",
            f"SIGKILL at `{point}`, 3 times, 2 workers",
            functools.partial(_phase, point=point),
        )
        for point in chaos.POINTS
    ]
    steps += [
        Step(
            "aof_always",
            "Redis SIGKILLed and restarted twice, AOF appendfsync always",
            lambda d, seed: chaos.redis_restart(
                d, "always", requests=2000, restarts=2, duration_s=10.0, seed=seed
            ),
        ),
        Step(
            "aof_everysec",
            "Redis SIGKILLed and restarted twice, AOF appendfsync everysec with its last "
            "32 KiB cut (a power cut), re-send by rid",
            lambda d, seed: chaos.redis_restart(
                d,
                "everysec",
                requests=2000,
                restarts=2,
                duration_s=10.0,
                lose_tail_kb=32,
                seed=seed,
            ),
        ),
        Step(
            "client_kill",
            "CLIENT KILL TYPE normal about every second, 2 workers",
            lambda d, seed: chaos.client_kills(
                d, requests=2000, duration_s=15.0, interval_s=1.0, seed=seed
            ),
        ),
        Step(
            "flushall",
            "FLUSHALL while 3,000 requests drain, then 1,000 more",
            lambda d, seed: chaos.flushall(d, before=3000, after=1000, seed=seed),
        ),
        Step(
            "crash_pill",
            "Crash pill in a batch with 31 healthy requests, max_deliveries 3",
            lambda d, seed: chaos.crash_pill(d, healthy=31, max_deliveries=3, seed=seed),
        ),
        Step(
            "slow_batch",
            "Batches slower than claim_idle_ms (300 ms), 2 workers",
            lambda d, seed: chaos.slow_batch(d, requests=256, claim_idle_ms=300, seed=seed),
        ),
        Step(
            "sigterm",
            "SIGTERM mid-batch, grace 20 s",
            lambda d, seed: chaos.sigterm_mid_batch(d, requests=256, seed=seed),
        ),
        Step(
            "stopped_workers_fill",
            "Redis with 16 MiB of room under maxmemory (noeviction) filled while 3 workers "
            "are SIGSTOPped: 2 producers until RedisFull, raw XADDs until OOM; then a fresh "
            "worker and the resumed ones drain it",
            lambda d, seed: chaos.stopped_workers_fill(
                d, workers=3, producers=2, maxmemory_mib=16, seed=seed
            ),
        ),
        Step(
            "full_speed_small_maxmemory",
            "3 producers at full speed for 15 s against 8 MiB of room under maxmemory, "
            "2 workers on a model twice as deep as the others' (so that the producers outrun "
            "them): 2 back off on RedisFull and resend, 1 waits (wait_for_backlog); all read "
            "their replies",
            lambda d, seed: chaos.full_speed_small_maxmemory(
                d,
                duration_s=15.0,
                workers=2,
                refusing=2,
                waiting=1,
                maxmemory_mib=8,
                work_depth=16,
                seed=seed,
            ),
        ),
    ]
    steps += [_hostile(h) for h in reliability_hostile.SINGLE]
    if fuzz_n:
        steps.append(
            Step(
                "fuzz",
                f"{fuzz_n:,} fuzzed requests against a worker subprocess",
                lambda d, seed: _fuzz(d, fuzz_n, seed),
            )
        )
    return steps


def _hostile(scenario: reliability_hostile.Hostile) -> Step:
    return Step(scenario.key, scenario.title, functools.partial(reliability_hostile.run, scenario))


def _phase(workdir: Path, seed: int, *, point: str) -> chaos.Result:
    return chaos.phase_kills(workdir, point, requests=600, workers=2, kills=3, seed=seed)


def _fuzz(workdir: Path, n: int, seed: int) -> chaos.Result:
    """tests/fuzzing's fuzz_worker against a worker subprocess serving the demo model."""
    res = chaos.Result("fuzz")
    if importlib.util.find_spec("fuzzing") is None:
        res.notes["skipped"] = "the tests/fuzzing package does not exist"
        return res
    import fuzzing
    import onnxruntime as ort
    from harness import write_config

    from tools.localredis import LocalRedis

    target = fuzzing.FuzzTarget("demo", max_request_bytes=16384, max_batch_size=32)
    home = workdir / "fuzz"
    home.mkdir(parents=True, exist_ok=True)
    exec_log = home / "exec.log"
    t0 = time.monotonic()
    with LocalRedis() as server:
        config = write_config(
            home,
            "demo",
            server.url,
            batching="max_batch_size = 32\nmax_wait_ms = 2",
            extra=f"[limits]\nmax_request_bytes = {target.max_request_bytes}",
        )
        session = ort.InferenceSession(str(home / "demo.onnx"), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]

        def reference(feeds: dict[str, Any]) -> dict[str, Any]:
            return dict(zip(names, session.run(names, dict(feeds)), strict=True))

        with (home / "worker.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "worker", "--config", str(config), "--name", "fuzz"],
                cwd=ROOT,
                env={**os.environ, "REDBATCH_EXEC_LOG": str(exec_log)},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        try:
            fuzzing.wait_for_worker(server.url, target)
            summary: dict[str, Any] = fuzzing.fuzz_worker(
                server.url, n, seed, target=target, worker_pid=proc.pid, reference=reference
            )
        finally:
            proc.terminate()
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    res.seconds = round(time.monotonic() - t0, 1)
    runs = Counter(line.split()[0] for line in exec_log.read_text().splitlines() if line)
    res.requests = int(summary["inputs"]) + int(summary["healthy_requests"])
    res.malformed = int(summary["inputs"])
    res.crashes = int(summary["crashes"]) + (rc != 0)
    res.lost = int(summary["missing_replies"])
    res.duplicates = sum(c - 1 for c in runs.values() if c > 1)
    res.peak_rss_kb = int(summary["worker_rss_mb"]["peak"] * 1024)
    res.notes.update(
        codes=summary["replies_by_code"],
        rss_growth_mb=summary["worker_rss_mb"]["growth"],
        dead_lettered=summary["dead_lettered"],
        inputs_per_s=summary["inputs_per_s"],
    )
    if not summary["ok"] or rc != 0:
        bad = {k: summary[k] for k in ("duplicate_replies", "wrong_codes", "wrong_outputs")}
        res.problems.append(f"fuzzing failed (exit {rc}): {bad} {summary['failure_examples']}")
    return res


def _machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    redis_v = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout.split()
    version = next((w.split("=")[1] for w in redis_v if w.startswith("v=")), "?")
    import onnxruntime
    import redis

    return (
        f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, Redis {version}, redis-py {redis.__version__}, "
        f"onnxruntime {onnxruntime.__version__}"
    )


def _mib(kb: int) -> str:
    return f"{kb / 1024:.0f} MiB" if kb else "-"


def _notes(res: chaos.Result) -> str:
    skip = {"dead_reasons"}
    parts = [f"{k}: {v}" for k, v in res.notes.items() if k not in skip and v not in (0, [], "")]
    parts += [f"PROBLEM: {p[:400]}" for p in res.problems]  # a table cell: one short line
    return "; ".join(parts).replace("|", "/").replace("\n", " ")


def _table(results: Sequence[tuple[Step, chaos.Result]]) -> list[str]:
    rows = [
        "| scenario | requests | kills | worker restarts | Redis restarts | duplicates executed "
        "| lost | malformed inputs tried | crashes | peak worker RSS | seconds | result | notes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for step, r in results:
        verdict = "pass" if r.passed else "**FAIL**"
        if "skipped" in r.notes:
            verdict = "skipped"
        rows.append(
            f"| {step.title} | {r.requests:,} | {r.kills} | {r.worker_restarts} | "
            f"{r.redis_restarts} | {r.duplicates} | {r.lost} | {r.malformed:,} | {r.crashes} | "
            f"{_mib(r.peak_rss_kb)} | {r.seconds} | {verdict} | {_notes(r)} |"
        )
    return rows


def render(results: Sequence[tuple[Step, chaos.Result]], command: str, seed: int) -> str:
    """The report: what was run, where, the table, and the totals."""
    rows = _table(results)
    lanes = reliability_cluster.lane_table([(step.key, r) for step, r in results])
    total = [r for _, r in results]
    passed = sum(r.passed for r in total)
    return f"""# Reliability: the fault-injection suite's full tier

Generated by `scripts/reliability.py` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; reproduce with:

```sh
{command}
```

Machine: {_machine()}. Seed {seed}.

Every scenario runs real worker subprocesses (`python -m worker`) against its own `redis-server`,
serving a model built in the test code (`tests/chaos/model.py`: `y = tanh(x @ W + b)`, `[N, 8] ->
[N, 4]`, not in the repository), with 2 to 3% malformed or invalid requests mixed in. The oracle
then checks, black box: every request has exactly one reply (the reply list's length is 1),
equal to the direct onnxruntime output or the expected error code; the stream is empty and
nothing is pending; the dead-letter stream holds exactly the injected poison; the consumer list
is bounded by the live workers. Duplicate executions are counted from `REDBATCH_EXEC_LOG`: a
worker killed after running a batch and before its finish script leaves the batch to be run
again (at-least-once), and that is allowed and counted, never a second reply.

{chr(10).join(rows)}

**{passed} of {len(total)} scenarios passed**; {sum(r.requests for r in total):,} requests,
{sum(r.kills for r in total)} worker SIGKILLs, {sum(r.redis_restarts for r in total)} Redis
restarts, {sum(r.duplicates for r in total)} duplicate executions,
{sum(r.lost for r in total)} lost, {sum(r.crashes for r in total)} crashes.

## Lanes

A laned scenario (contract section 7) sends each request to a lane drawn at random
(`tests/chaos/lanes.py`): a fifth of them as raw version 2 `XADD`s to `P:{{T}}:requests`, the
rest to classes high and low without a tenant and to all three classes of tenants `ta` and
`tb`, as a version 3 producer does (`MULTI; SADD P:{{T}}:lanes LANE; XADD LANE ...; EXEC`, a
tenant's rid beginning `ta.`). The oracle requires, besides everything above, each reply's
`class` and `tenant` to be its lane's and every lane stream drained. The laned random kills
run batches of 4 rows, so that lower-class requests of 2 and 3 rows are often split across two
batches behind higher-class ones (`worker/answer/parts.py`) and a worker is killed between a
request's parts (the next one runs it whole): "answered once", the outputs the oracle checks and
"duplicates executed" cover the splitting too. The cluster tier's `failover_lanes` kills the
master only once a request of every lane of its shard was answered. Per lane:

{chr(10).join(lanes) if lanes else "(no laned scenario in this run)"}

## What the columns mean

- **kills**: workers that died of SIGKILL, whether sent by the driver at a random moment or by
  a fault point (`REDBATCH_FAULTS`, `worker/ops/faults.py`) or the crash pill; each was restarted as
  an orchestrator would (worker restarts).
- **duplicates executed**: executions beyond the first, over all requests, from the execution log.
- **lost**: requests with no reply at the end. Under `flushall` only requests sent after the
  flush count; what the flush deleted is gone by definition (shown in the notes).
- **crashes**: worker exits that nobody caused (anything but exit 0 or SIGKILL).
- **peak worker RSS**: the largest VmHWM of any worker process, sampled every 100 ms.
- Under `aof_always` nothing confirmed by XADD is re-sent, so lost = 0 means nothing it
  confirmed was lost; the producer re-sends only the chunks whose XADD failed. Under
  `aof_everysec` the producer re-sends, with the same rid, what has no reply once the stream
  is drained (`recovered_by_resend`).

The fast tier runs the same scenarios at small sizes in CI: `.venv/bin/python -m pytest
tests/test_faults.py` (about 100 s on 2 cores; its random kills go across lanes).

## Simulating lost writes under `appendfsync everysec`

A SIGKILLed `redis-server` loses nothing it had written, even under `everysec`: the data is in
the page cache. A power cut would lose what was written since the last fsync, so the everysec
scenario cuts the last 32 KiB of the AOF while Redis is down, at a command boundary outside any
`MULTI` block. What that removes (XADDs, replies with their acks, deliveries) comes back as
unanswered requests that the producer re-sends with the same rid, and as entries delivered and
run again (the duplicates column).

Cutting *inside* a `MULTI` block instead (a torn write) shows a Redis 7.0.15 bug, not a worker
one: the server logs "Revert incomplete MULTI/EXEC transaction ... Truncating the AOF at offset
N" but leaves the open block in the file, and the next `EXEC` appended after it makes a later
restart replay it, so a finish script's `RPUSH` rolled back once comes back on top of the reply
written since: a reply list with two replies. Reproduction: AOF on, `MULTI; RPUSH reply A; SET
acked yes; EXEC`, SIGKILL, cut the file a few bytes into that block, start (the reply is gone, as
it should be; the file still ends in the open block), `SET later 1`, SIGKILL, start: `later` is
gone too.

## A full Redis: `maxmemory` with `noeviction`

Two scenarios run against a Redis with a small `maxmemory` (set, once the workers are
connected, to what Redis uses then plus the scenario's room) and `maxmemory-policy noeviction`,
with requests sent through `producer.Client` (default `memory_high_watermark`, 0.8) and no
malformed requests. They check that a full Redis never wedges the queue: producers are refused
early with `RedisFull` and with nothing else (any other error fails the scenario: `other_errors`),
and workers answer, acknowledge and delete (scripts flagged `allow-oom`) even past `maxmemory`.

- `stopped_workers_fill`: the workers are SIGSTOPped; the producers `submit_many` until each is
  refused (`refused_by`: at the watermark, or by Redis's own OOM); then raw XADDs, which no
  watermark stops, fill the room the watermark left until Redis refuses one for memory
  (`raw_xadds_past_watermark`), and a client with its watermark off must get `RedisFull` there
  too. A fresh worker started on that Redis, past `maxmemory`, must become ready
  (`fresh_ready_s`, its registry record) and serve (`answered_by_fresh`); the stopped workers are
  then SIGCONTed. `drain_s` runs from the fresh worker's start to an empty stream with nothing
  pending; the oracle then checks every accepted request. `peak_used_mib` is the largest
  `used_memory` sampled every 20 ms through the fill and the drain, and `used_drained_mib` Redis
  memory once drained: the replies, written past `maxmemory`, take more room than the requests
  did, until their producers read them (`used_after_reading_mib`); the producers then submit
  again. Duplicates are expected here: the first entries reached workers blocked in
  `XREADGROUP` after they were stopped, so the fresh worker claims them after `claim_idle_ms`
  and the resumed owner runs them too, its finish then writing nothing (at-least-once).
- `full_speed_small_maxmemory`: the producers outrun the workers and reach the watermark again
  and again (`refused_calls`, per producer in `refused_by_producer`); one that is refused backs
  off 50 ms and sends the same rows again as new requests, one with `wait_for_backlog=True`
  waits inside `submit_many` (`longest_waiting_submit_s`). Each producer reads its replies as it
  goes (a reader thread calling `wait_many`), as a real user would: replies nobody reads hold
  memory for `reply_ttl_s` (the workers keep the default, 3600 s). The oracle here is what the
  producers read: every accepted request read exactly once with the right output, no reply list
  left in Redis afterwards (a second reply), an empty stream and nothing pending. `drain_s` runs
  from the producers' stop to an empty stream; `peak_used_mib` is the largest `used_memory`
  sampled every 20 ms, against `maxmemory_mib`.

The fast tier runs both at small sizes in CI: `.venv/bin/python -m pytest tests/test_overload.py`.

## Hostile producers and a refusing Redis

The rows from `reply_over_bulk_limit` to `cancelled_calls` are the faults a hostile producer, a
careless operator or a refusing Redis brings (contract version 3, sections 2 and 4;
`scripts/reliability_hostile.py`). Each runs the fast tier's tests of that fault
(`tests/test_hardening_*.py`, `tests/test_stream_damage.py`, `tests/test_image_bounds.py`) in a
pytest process of its own, each test with its own redis-server and real workers, asserting the
behaviour: a reply Redis will not take answered alone and the worker alive, wrong-type keys
dead-lettered or failed alone without a crash loop, a damaged stream logged, counted, shown and
repaired, oversized bodies refused before sending, extra fields refused without keeping their
bytes, Redis memory bounded during a malformed flood, misconfigurations stopping at once,
SIGTERM and `/healthz` with Redis paused, duplicate names refused, cancelled calls leaving no
orphan. The request columns stay 0 there (the tests count their own); the notes carry the
figures the tests print (`peak_x_maxmemory`, `readmitted_s`, `rss_after_mib`, `too_large_s`)
and their pytest summary. The cluster tier runs the same faults on a model's second shard
(`tests/test_hardening_cluster.py`).

## Fault points and what cannot be interrupted

The worker's reply, acknowledgement and deletion are one Lua script, so "after the reply,
before the ack" and "between the ack and the delete" are not points a crash can reach: a worker
killed during the script leaves all three done or none. The suite kills around the script
instead: `after_read` (entries read, not decoded), `after_inference` (batch run, replies not yet
handed to the writer), `before_finish` (just before the script) and `after_finish` (just after).
"""


def _write(results: Sequence[tuple[Step, chaos.Result]], command: str, args: Any) -> None:
    """Write (or print) the report; ``--cluster`` rewrites only its Redis Cluster section."""
    before = args.out.read_text() if str(args.out) != "-" and args.out.exists() else ""
    if args.cluster:
        titled = [(step.title, res) for step, res in results]
        section = reliability_cluster.render(
            titled, _table(results), command, _machine(), args.seed
        )
        report = reliability_cluster.splice(before, section)
    else:  # the cluster tier's section stays, from its own last run
        report = reliability_cluster.keep_section(render(results, command, args.seed), before)
    if str(args.out) == "-":
        print(report)
    else:
        args.out.write_text(report)
        print(f"wrote {args.out}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=1, help="seed for load, kills and faults")
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        metavar="KEY",
        help="run only these scenarios (keys from --list, by spaces or commas)",
    )
    parser.add_argument(
        "--fuzz", type=int, default=100_000, help="fuzzed requests (0: skip; default 100000)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "reliability.md",
        help="report path (default docs/reliability.md); '-' prints it",
    )
    parser.add_argument("--keep", action="store_true", help="keep worker logs and exec logs")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run the Redis Cluster tier and rewrite only the report's Redis Cluster section",
    )
    args = parser.parse_args(argv)
    steps = _steps(args.fuzz)
    if args.cluster:
        steps = [Step(*step) for step in reliability_cluster.steps()]
        steps += [_hostile(h) for h in reliability_hostile.CLUSTER]
    if args.list:
        for step in steps:
            print(f"{step.key:28} {step.title}")
        return 0
    if args.only:
        args.only = [key for arg in args.only for key in arg.split(",") if key]
        unknown = set(args.only) - {s.key for s in steps}
        if unknown:
            parser.error(f"unknown scenario(s) {sorted(unknown)}; see --list")
        steps = [s for s in steps if s.key in args.only]

    workdir = Path(tempfile.mkdtemp(prefix="redbatch-reliability-"))
    results: list[tuple[Step, chaos.Result]] = []
    t0 = time.monotonic()
    for i, step in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {step.key}: {step.title} ...", flush=True)
        try:
            res = step.run(workdir, args.seed)
        except Exception as exc:
            res = chaos.Result(step.key, problems=[f"scenario raised {exc!r}"])
        results.append((step, res))
        verdict = "pass" if res.passed else "FAIL"
        print(
            f"    {verdict} in {res.seconds}s: {res.requests} requests, {res.kills} kills, "
            f"{res.duplicates} duplicates, {res.lost} lost, {res.crashes} crashes",
            flush=True,
        )
        for problem in res.problems:
            print(f"    - {problem}", flush=True)
    print(f"all scenarios in {time.monotonic() - t0:.0f}s; work files in {workdir}")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)

    argv_used = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join([".venv/bin/python", "scripts/reliability.py", *argv_used])
    _write(results, command, args)
    return 0 if all(r.passed for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
