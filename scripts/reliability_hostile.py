"""The hostile-producer and refusing-Redis scenarios, as rows of scripts/reliability.py's report.

Each scenario is a test of the fast tier (``tests/test_hardening_*.py``,
``tests/test_stream_damage.py``, ``tests/test_image_bounds.py``): a real redis-server, a real
worker, and an assertion of the behaviour the contract asks for (section 4, version 3). Here each
runs in a pytest process of its own, so that a row is one scenario: its verdict, its time, and
the figures its test prints as ``FIGURE name=value`` lines (peak memory, RSS, seconds to a
refusal), which become the row's notes.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import chaos

ROOT = Path(__file__).resolve().parents[1]

_FIGURE = re.compile(r"^FIGURE (\w+)=(\S+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Hostile:
    """One scenario: its report key and title, and the pytest node ids that assert it."""

    key: str
    title: str
    tests: tuple[str, ...]


def run(scenario: Hostile, workdir: Path, seed: int) -> chaos.Result:
    """Run the scenario's tests in a fresh pytest process; fail the row if any fails."""
    del workdir, seed  # each test makes its own servers and inputs
    res = chaos.Result(scenario.key)
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            *scenario.tests,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    res.seconds = round(time.monotonic() - started, 1)
    res.notes.update(dict(_FIGURE.findall(done.stdout)))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "no output"
    res.notes["tests"] = summary.strip("= ")
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        res.problems.append(f"pytest exit {done.returncode}: {' / '.join(tail)}")
    return res


def _k(path: str, expr: str) -> tuple[str, ...]:
    return (path, "-k", expr)


#: The faults of issue 26, on one Redis: each row names what it asserts.
SINGLE = (
    Hostile(
        "reply_over_bulk_limit",
        "A reply over Redis's proto-max-bulk-len (1 MiB), batched with small ones: it alone is "
        "TOO_LARGE, the others served, the worker alive; also with CONFIG GET refused and "
        "limits.max_reply_bytes set",
        _k("tests/test_hardening_replies.py", "bulk_limit or config_get"),
    ),
    Hostile(
        "wrong_type_keys",
        "Reply keys set to a string or a hash (inline and staged replies): dead-lettered alone "
        "with the reason; a dead-letter key of another type: no exit, no crash loop over a "
        "restart; wait_many keeps the other replies",
        (
            "tests/test_hardening_finish.py",
            "tests/test_hardening_client.py::test_wait_many_returns_every_reply_beside_a_key_of_the_wrong_type",
            "tests/test_hardening_client.py::test_concurrent_waits_keep_their_replies_beside_a_key_of_the_wrong_type",
        ),
    ),
    Hostile(
        "stream_damage",
        "A producer's XADD MAXLEN 0, XTRIM MINID, DEL of the stream, XGROUP DESTROY and an XADD "
        "of the largest id: logged, counted, shown by status; the documented repair serves again",
        ("tests/test_stream_damage.py",),
    ),
    Hostile(
        "oversized_body",
        "A body over the bulk limit or a worker's max_request_bytes: TooLarge before sending, "
        "in under 2 s, while 30 concurrent AsyncClient.infer calls succeed",
        _k("tests/test_hardening_client.py", "oversized or over_the_live or byte_limit"),
    ),
    Hostile(
        "extra_fields",
        "Entries with extra fields (4 x 20 MB, twice): MALFORMED, batch-mates served, the worker "
        "subprocess's RSS back within 50 MiB",
        ("tests/test_hardening_intake.py",),
    ),
    Hostile(
        "hostile_images",
        "The image example: a 16-bit 6000 x 6000 PNG of 70 KB and large-dimension images "
        "refused from their headers, before decoding",
        ("tests/test_image_bounds.py",),
    ),
    Hostile(
        "malformed_flood",
        "Raw XADDs of malformed requests against 16 MiB maxmemory (noeviction): Redis under "
        "1.5 x maxmemory, producers admitted again within 60 s",
        _k("tests/test_hardening_replies.py", "flood or compact or ceiling"),
    ),
    Hostile(
        "refusing_redis",
        "MISCONF ridden out; TLS/plain mismatch both ways, a certificate that does not verify, "
        "a wrong password: exit 2 and Misconfigured within seconds; SIGTERM and /healthz with "
        "Redis paused; a live worker's name refused",
        ("tests/test_hardening_lifecycle.py",),
    ),
    Hostile(
        "cancelled_calls",
        "AsyncClient.infer cancelled (task.cancel, wait_for) and Client.infer interrupted: the "
        "cancel key is set; the client never sends trimming options",
        _k("tests/test_hardening_client.py", "cancel or interrupted or trimming"),
    ),
)

#: The same faults where a shard applies, on a six-node cluster (3 masters, 3 replicas).
CLUSTER = (
    Hostile(
        "cluster_hostile",
        "On a model's second shard: a reply key of another type and an extra field fail alone, "
        "a trim is reported for that shard, a body over the bulk limit is refused before "
        "sending, a reply over it is TOO_LARGE alone",
        ("tests/test_hardening_cluster.py",),
    ),
)
