"""The oracle: what Redis and the execution log say after a scenario, judged against what each
request must be answered with, into a ``Result``."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import redis

from producer.protocol.codec import Reply, WireFormatError, decode_reply
from producer.protocol.keys import CONSUMER_GROUP, reply_key

from .common import DEAD, MODEL, PREFIX, ScenarioTimeout, wait_for
from .lanes import LaneBook

if TYPE_CHECKING:
    from .processes import Pool, Settings
    from .workload import Requests


@dataclass
class Result:
    """One scenario's figures, as the report's table shows them."""

    name: str
    requests: int = 0
    kills: int = 0
    worker_restarts: int = 0
    redis_restarts: int = 0
    duplicates: int = 0
    lost: int = 0
    malformed: int = 0
    crashes: int = 0
    peak_rss_kb: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    # per lane (``lanes.label``): sent, answered, lost, doubled, duplicates; empty unless laned
    lanes: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.problems


def describe(res: Result) -> str:
    """A failure message: the figures and every problem the oracle found."""
    lines = [f"scenario {res.name}: {res}"] + [f"  - {p}" for p in res.problems]
    return "\n".join(lines)


_BAD_CODES = frozenset({"MALFORMED", "INVALID_INPUT"})


class Oracle(LaneBook):
    """The state and verdict half of ``Run``: reads Redis and the exec log, fills ``result``."""

    r: redis.Redis
    requests: Requests
    pool: Pool
    settings: Settings
    result: Result
    resent: Counter[str]
    exec_log: Path
    _t0: float

    def streams(self) -> list[tuple[redis.Redis, str]]:
        """(client, key) of every request stream to judge: each lane sent to, the default
        lane always."""
        return [(self.r, key) for key in self.lane_streams(MODEL)]

    # State -----------------------------------------------------------------------------------

    def reply_counts(self, rids: Sequence[str]) -> list[int]:
        pipe = self.r.pipeline(transaction=False)
        for rid in rids:
            pipe.llen(reply_key(PREFIX, MODEL, rid))
        return [int(n) for n in pipe.execute()]

    def drained(self) -> bool:
        """XLEN 0 and nothing pending in every stream (a missing stream or group, a lane the
        workers removed once empty, counts as drained)."""
        for client, key in self.streams():
            try:
                if client.xlen(key) or any(g["pending"] for g in client.xinfo_groups(key)):
                    return False
            except redis.ResponseError:
                continue
        return True

    def consumers(self) -> list[dict[str, Any]]:
        """Every stream's consumers, merged by name (pending summed)."""
        pending: dict[bytes, int] = {}
        for client, key in self.streams():
            with contextlib.suppress(redis.ResponseError):
                for c in client.xinfo_consumers(key, CONSUMER_GROUP):
                    pending[c["name"]] = pending.get(c["name"], 0) + int(c["pending"])
        return [{"name": name, "pending": n} for name, n in pending.items()]

    def pending_of(self, name: str) -> int:
        return next((int(c["pending"]) for c in self.consumers() if c["name"].decode() == name), 0)

    def executions(self) -> Counter[str]:
        if not self.exec_log.exists():
            return Counter()
        return Counter(line.split()[0] for line in self.exec_log.read_text().splitlines() if line)

    # The oracle ------------------------------------------------------------------------------

    def check(
        self,
        rids: Sequence[str],
        *,
        poison: Sequence[str] = (),
        timeout_s: float = 60.0,
        consumer_slack: int = 1,
    ) -> Result:
        """Wait for the replies and a drained stream, then judge everything; fills ``result``."""
        res = self.result
        res.requests = len(rids)
        res.malformed = sum(1 for rid in rids if self.requests.expected[rid].code in _BAD_CODES)
        deadline = time.monotonic() + timeout_s

        with contextlib.suppress(ScenarioTimeout):
            wait_for(
                lambda: min(self.reply_counts(rids), default=1) >= 1, timeout_s, "replies", 0.2
            )
        counts = self.reply_counts(rids)
        missing = [rid for rid, n in zip(rids, counts, strict=True) if n == 0]
        doubled = [rid for rid, n in zip(rids, counts, strict=True) if n > 1]
        res.lost = len(missing)
        if missing:
            res.problems.append(f"{len(missing)} requests got no reply, e.g. {missing[:5]}")
        if doubled:
            res.problems.append(
                f"{len(doubled)} reply lists hold more than one reply: {doubled[:5]}; "
                f"the first: {self.describe_replies(doubled[0])}"
            )
        wrong, ok = self._judge_replies([rid for rid, n in zip(rids, counts, strict=True) if n])
        res.problems += wrong

        left = max(1.0, deadline - time.monotonic())
        try:
            wait_for(self.drained, left, "an empty stream with nothing pending", 0.2)
        except ScenarioTimeout as exc:
            lengths = {key: self._xlen(client, key) for client, key in self.streams()}
            res.problems.append(f"{exc}: XLEN {lengths}, groups {self._groups()}")

        letters: list[tuple[bytes, dict[bytes, bytes]]] = self.r.xrange(DEAD)  # type: ignore[assignment]
        dead = [f[b"rid"].decode() for _, f in letters if b"rid" in f]
        reasons = [f.get(b"reason") for _, f in letters]
        if sorted(dead) != sorted(poison):
            res.problems.append(
                f"dead-letter stream holds {sorted(dead)}, expected {sorted(poison)}"
            )
        if not all(reasons):
            res.problems.append("a dead letter has no reason")
        res.notes["dead_reasons"] = sorted({(r or b"").decode() for r in reasons})

        live = len(self.pool.live())
        bound = live + consumer_slack
        left = max(1.0, deadline - time.monotonic(), 4 * self.settings.claim_idle_ms / 1000 + 2)
        with contextlib.suppress(ScenarioTimeout):
            wait_for(lambda: len(self.consumers()) <= live, left, "dead consumers removed", 0.2)
        names = [c["name"].decode() for c in self.consumers()]
        res.notes["consumers_at_end"] = len(names)
        if len(names) > bound:
            res.problems.append(f"{len(names)} consumers for {live} live workers: {names}")

        execs = self.executions()
        res.duplicates = sum(
            n - 1 for rid, n in execs.items() if n > 1 and rid in self.requests.bodies
        )
        unlogged = [rid for rid in ok if not execs[rid]]
        if unlogged:  # the count above would be meaningless
            res.problems.append(f"{len(unlogged)} answered requests not in REDBATCH_EXEC_LOG")
        res.notes["resent_by_producer"] = sum(self.resent.values())
        res.lanes = self.lane_figures(rids, counts, execs)
        return self.finish()

    @staticmethod
    def _xlen(client: redis.Redis, key: str) -> int | str:
        try:
            return int(client.xlen(key))
        except redis.ResponseError as exc:
            return str(exc)

    def describe_replies(self, rid: str) -> str:
        """Every reply in ``rid``'s list (worker, outcome) and its executions, for a report."""
        raws: list[bytes] = self.r.lrange(reply_key(PREFIX, MODEL, rid), 0, -1)  # type: ignore[assignment]
        seen = []
        for raw in raws:
            reply = decode_reply(raw)
            outcome = reply.error.code if reply.error else "OK"
            seen.append(
                f"{reply.worker}:{outcome}:queued {reply.timings_ms.get('queued', 0):.0f}ms"
            )
        return f"replies {seen}, executions {self.executions()[rid]}, sent {1 + self.resent[rid]}x"

    def _groups(self) -> list[dict[str, Any]]:
        groups = []
        for client, key in self.streams():
            with contextlib.suppress(redis.ResponseError):
                groups += [{"stream": key, **g} for g in client.xinfo_groups(key)]
        return groups

    def lane_problem(self, rid: str, reply: Reply) -> str | None:
        """What is wrong with ``reply``'s ``class`` and ``tenant`` for ``rid``'s lane."""
        cls, tenant = self.lane(rid)
        if (reply.cls, reply.tenant) != (cls, tenant):
            return (
                f"{rid}: sent to lane ({cls}, {tenant}), its reply says {(reply.cls, reply.tenant)}"
            )
        return None

    def _judge_replies(self, rids: Sequence[str]) -> tuple[list[str], list[str]]:
        """(problems, rids answered with outputs) for requests that have a reply."""
        pipe = self.r.pipeline(transaction=False)
        for rid in rids:
            pipe.lindex(reply_key(PREFIX, MODEL, rid), 0)
        wrong: list[str] = []
        ok: list[str] = []
        for rid, raw in zip(rids, pipe.execute(), strict=True):
            want = self.requests.expected[rid]
            try:
                reply = decode_reply(raw)
            except WireFormatError as exc:
                wrong.append(f"{rid}: undecodable reply ({exc})")
                continue
            if reply.rid != rid:
                wrong.append(f"{rid}: reply names rid {reply.rid}")
            elif (lane := self.lane_problem(rid, reply)) is not None:
                wrong.append(lane)
            elif want.code is not None:
                got = reply.error.code if reply.error else "OK"
                if got != want.code:
                    wrong.append(f"{rid}: expected {want.code}, got {got}")
            elif not reply.ok or reply.outputs is None:
                wrong.append(f"{rid}: expected outputs, got {reply.error}")
            elif want.y is None or not np.allclose(reply.outputs["y"], want.y, 1e-5, 1e-6):
                wrong.append(f"{rid}: outputs differ from the direct onnxruntime run")
            else:
                ok.append(rid)
        return ([f"{len(wrong)} wrong replies: {wrong[:5]}"] if wrong else []), ok

    def finish(self) -> Result:
        """Worker figures into the result (call after the oracle; stops nothing)."""
        res = self.result
        res.kills = self.pool.kills
        res.worker_restarts = self.pool.restarts
        crashes = self.pool.crashes
        res.crashes = len(crashes)
        if crashes:
            res.problems.append(f"workers crashed: {crashes}")
        for w in self.pool.live():
            w.sample_rss()
            res.peak_rss_kb = max(res.peak_rss_kb, w.peak_rss_kb)
        res.peak_rss_kb = max(res.peak_rss_kb, self.pool.peak_rss_kb)
        res.seconds = round(time.monotonic() - self._t0, 1)
        return res
