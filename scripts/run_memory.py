#!/usr/bin/env python3
"""Peak memory of ``redbatch run`` as its input grows: it must not grow with the input.

For each input kind, builds inputs of N, 10N and 100N rows (``--rows``, ``--scales``) in a
temporary folder, starts a private redis-server and an echo worker (a thread in this process,
``tests/test_run_sources.EchoWorker``: each string or bytes input comes back with its lengths,
each number doubled), and runs ``python -m producer run`` as a child process that reports, as
it exits, its own peak resident memory (``VmHWM`` in ``/proc/self/status``: the peak since its
``exec``; ``resource``'s ``ru_maxrss`` of a child would also count this process's memory at
the fork, which ``exec`` keeps) and the peak of its anonymous memory (``RssAnon``, sampled
every 20 ms: an .npy is memory-mapped, and the pages of it read count in RSS though the kernel
may drop them at any time, being clean and file-backed). Prints one table row per run: kind,
rows, input size, output, both peaks, and the job's throughput (its own summary: rows answered
per second of the job, start-up not counted); then whether the peak stayed flat from the last
but one size to the last (within ``--slack-mib``; the anonymous peak for .npy); exit status 1
if not. The first sizes may fit inside the run's window (``--concurrency`` requests of
``--rows-per-request`` rows in flight, an output row group), so only the last step is judged.

    python scripts/run_memory.py                  # text, jsonl, parquet, files; .parquet out
    python scripts/run_memory.py --kinds npy,text --output npz
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402

from tools.localredis import LocalRedis  # noqa: E402

KINDS = ("text", "jsonl", "parquet", "files", "npy")
MIB = 1 << 20

# The child: redbatch's command line, reporting its two peaks as it exits (the docstring).
CHILD = """
import atexit, sys, threading, time
def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1])
    return 0
anon = [0]
def sample():
    while True:
        anon[0] = max(anon[0], status('RssAnon'))
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
def report():
    anon[0] = max(anon[0], status('RssAnon'))
    sys.stderr.write('PEAK_KIB %d ANON_KIB %d\\n' % (status('VmHWM'), anon[0]))
atexit.register(report)
from producer.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def build(kind: str, rows: int, folder: Path) -> tuple[Path, list[str]]:
    """An input of ``rows`` rows of ``kind``, and the run options it needs."""
    rng = np.random.default_rng(rows)
    if kind == "text":
        path = folder / "in.txt"
        with path.open("w") as fh:
            for i in range(rows):
                fh.write(f"sentence {i} " + "lorem ipsum dolor sit amet " * 3 + "\n")
        return path, ["--input-name", "text"]
    if kind == "jsonl":
        path = folder / "in.jsonl"
        with path.open("w") as fh:
            for i in range(rows):
                v = [round(float(x), 4) for x in rng.random(8)]
                fh.write(json.dumps({"id": i, "text": f"query {i} lorem ipsum", "v": v}) + "\n")
        return path, ["--key", "id"]
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "in.parquet"
        with pq.ParquetWriter(path, _parquet_schema(pa)) as writer:
            for start in range(0, rows, 65536):
                n = min(65536, rows - start)
                values = pa.array(rng.random(n * 8, dtype=np.float32))
                table = pa.table(
                    {
                        "id": np.arange(start, start + n),
                        "text": [f"row {i} lorem ipsum dolor" for i in range(start, start + n)],
                        "v": pa.FixedSizeListArray.from_arrays(values, 8),
                    }
                )
                writer.write_table(table)
        return path, ["--key", "id"]
    if kind == "files":
        path = folder / "files"
        path.mkdir()
        for i in range(rows):
            sub = path / f"{i // 1000:04d}"
            sub.mkdir(exist_ok=True)
            (sub / f"{i:08d}.bin").write_bytes(rng.bytes(1024))
        return path, ["--input-name", "blob"]
    path = folder / "in.npy"
    np.save(path, rng.random((rows, 32), dtype=np.float32))
    return path, ["--input-name", "x"]


def _parquet_schema(pa: object) -> object:
    return pa.schema(  # type: ignore[attr-defined]
        [
            ("id", pa.int64()),  # type: ignore[attr-defined]
            ("text", pa.string()),  # type: ignore[attr-defined]
            ("v", pa.list_(pa.float32(), 8)),  # type: ignore[attr-defined]
        ]
    )


def input_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def measure(url: str, path: Path, options: list[str], output: Path, rows_per_request: int) -> dict:
    """Run ``redbatch run`` in a child process; its peak RSS, wall time and throughput."""
    argv = [sys.executable, "-c", CHILD, "--redis-url", url, "run", "--model", "echo"]
    argv += ["--input", str(path), "--output", str(output), "--no-progress"]
    argv += ["--rows-per-request", str(rows_per_request), *options]
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"redbatch run exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    peak = re.search(r"PEAK_KIB (\d+) ANON_KIB (\d+)", done.stderr)
    rate = re.search(r"throughput ([\d,]+) rows/s", done.stdout)
    if peak is None or rate is None:
        raise SystemExit(f"no peak or throughput reported:\n{done.stdout}\n{done.stderr}")
    rows_per_s = float(rate.group(1).replace(",", ""))
    return {
        "peak_mib": int(peak.group(1)) / 1024,
        "anon_mib": int(peak.group(2)) / 1024,
        "wall_s": wall_s,
        "rows_per_s": rows_per_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="text,jsonl,parquet,files")
    parser.add_argument("--rows", type=int, default=20_000, help="N, the smallest input's rows")
    parser.add_argument("--files-rows", type=int, default=2000, help="N for files (1 KiB each)")
    parser.add_argument("--scales", default="1,10,100")
    parser.add_argument("--output", choices=("parquet", "npz"), default="parquet")
    parser.add_argument("--rows-per-request", type=int, default=64)
    parser.add_argument("--slack-mib", type=float, default=32.0)
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    scales = [int(s) for s in args.scales.split(",")]
    from test_run_sources import EchoWorker

    flat = True
    print(
        f"{'kind':<8} {'rows':>10} {'input MiB':>10} {'output':>7} {'peak RSS MiB':>13} "
        f"{'peak anon MiB':>14} {'wall s':>7} {'job rows/s':>11}"
    )
    with LocalRedis() as server, tempfile.TemporaryDirectory() as tmp:
        echo = EchoWorker(server.url)
        echo.start()
        try:
            for kind in kinds:
                peaks = []
                for scale in scales:
                    rows = (args.files_rows if kind == "files" else args.rows) * scale
                    folder = Path(tmp) / f"{kind}-{scale}"
                    folder.mkdir()
                    path, options = build(kind, rows, folder)
                    output = folder / f"out.{args.output}"
                    got = measure(server.url, path, options, output, args.rows_per_request)
                    peaks.append(got["anon_mib"] if kind == "npy" else got["peak_mib"])
                    print(
                        f"{kind:<8} {rows:>10,} {input_bytes(path) / MIB:>10.1f} "
                        f"{args.output:>7} {got['peak_mib']:>13.1f} {got['anon_mib']:>14.1f} "
                        f"{got['wall_s']:>7.1f} {got['rows_per_s']:>11,.0f}",
                        flush=True,
                    )
                    shutil.rmtree(folder)
                grew = peaks[-1] - peaks[-2] if len(peaks) > 1 else 0.0
                ok = grew <= args.slack_mib
                flat = flat and ok
                print(
                    f"{kind:<8} peak {grew:+.1f} MiB from {scales[-2]}x to {scales[-1]}x: "
                    f"{'flat' if ok else 'GROWS'}"
                )
        finally:
            echo.stop()
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
