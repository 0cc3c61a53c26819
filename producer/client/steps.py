"""What a plan (``producer.client.plans``) asks of the shell that runs it, and the ``Stepper`` that
drives a plan for either shell.

A plan yields steps: ``Call`` (one redis-py command), ``Batch`` (many commands, one round trip
per node) or ``Sleep``. The shell takes each step, blocking (``Client``) or awaiting
(``AsyncClient``), through the step's retry policy, and hands the ``Stepper`` the answer or
the error, which the plan gets back where it yielded.

Every command names its shard tag (contract section 1): ``Routing`` turns the tag into the
redis-py client of the node serving it (``producer.redisio.topology``), and a ``Batch`` is made of
one ``Part`` per shard, so that no transaction or multi-key command spans two slots. The shell
groups a batch's parts by node at each try: on a single Redis every part goes in one round
trip, as before shards; on a cluster each node gets its own. A part that succeeded is not sent
again when another part's node failed and the batch is retried.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import redis.exceptions as rex

from producer.redisio import resp
from producer.redisio.retry import RetryPolicy
from producer.redisio.topology import is_redirect

__all__ = [
    "DONE",
    "REFRESH_MIN_S",
    "Batch",
    "Call",
    "CallerStopped",
    "Part",
    "Plan",
    "Routing",
    "Sleep",
    "Step",
    "Stepper",
    "packed",
    "pending",
    "queue",
    "settle",
]

R = TypeVar("R")

#: A plan: yields steps (and, when it streams, outputs), is sent answers, returns ``R``.
Plan = Generator[Any, Any, R]


@dataclass(eq=False, slots=True)
class Call:
    """One redis-py command, ``fn(redis)`` on the client of shard ``tag`` (None: the model's
    first), tried through ``retry`` (the asyncio shell awaits what ``fn`` returns); ``tries``
    counts the tries the shell made."""

    name: str  # the Redis command, for tests and debugging
    fn: Callable[[Any], Any]
    retry: RetryPolicy
    tag: str | None = None
    tries: int = 0


@dataclass(eq=False, slots=True)
class Part:
    """One shard's commands in a ``Batch``: hand-packed (``packer``) on a client with an
    ordinary pool, else queued by ``queue`` on a redis-py pipeline. ``check`` turns its replies
    into its ``answer`` (raising the first error); ``items`` is what it carries (submissions,
    keys), for the plan. ``done`` once answered: a retry of the batch skips it."""

    tag: str
    queue: Callable[[Any], None]
    packer: resp.Packer | None = None
    check: Callable[[list[Any]], Any] = resp.raise_first_error
    items: Sequence[Any] = ()
    done: bool = False
    answer: Any = None
    count: int = 0  # replies it owes in the round trip under way


@dataclass(eq=False, slots=True)
class Batch:
    """Many commands, one ``Part`` per shard, tried through ``retry``; the answer is each
    part's, in order."""

    name: str
    retry: RetryPolicy
    parts: list[Part]
    tries: int = 0

    def answers(self) -> list[Any]:
        return [part.answer for part in self.parts]


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds`` before the next step (Redis has no event for a stream shrinking)."""

    seconds: float


#: What a shell runs: the commands a plan yields.
Step = Call | Batch | Sleep


# ---------------------------------------------------------------------------------------------
# Routing steps to nodes

#: The least time between two reads of the slot map after errors: a failover takes seconds, and
#: a read per retry would only load the nodes left.
REFRESH_MIN_S = 1.0


class Routing:
    """Which redis-py client runs a step, and when the shell reads the slot map again.

    The map is read before the first command (one round trip for the client's life on a single
    Redis; tried again with the command while no node answers), then only after trouble: a
    ``MOVED`` repoints its slot at once (``follow``); an ``ASK``, ``TRYAGAIN``,
    ``CLUSTERDOWN``, a ``MOVED`` seen by a client whose map says single Redis, or a lost
    connection on a cluster (a dead master: its replica is promoted) asks for a fresh map
    before the retry, at most every ``REFRESH_MIN_S``.
    """

    __slots__ = ("_clients", "_due", "_mapped", "_refreshed_at", "model", "topology")

    def __init__(self, topology: Any, model: str) -> None:
        self.topology = topology
        self.model = model
        self._clients: dict[str, Any] = {}  # the topology's, without its lock
        self._mapped = False
        self._due = True
        self._refreshed_at = -math.inf

    def refresh_due(self) -> bool:
        """True when the shell should read the slot map before its next command."""
        if not self._due:
            return False
        return not self._mapped or time.monotonic() - self._refreshed_at >= REFRESH_MIN_S

    def refreshed(self) -> None:
        """Note a read of the slot map."""
        self._mapped, self._due = True, False
        self._refreshed_at = time.monotonic()

    def client(self, tag: str | None) -> Any:
        """The client of shard ``tag`` (None: the model's first): the same object for the
        tag's life, repointed by the topology when its slot moves."""
        tag = tag or self.model
        found = self._clients.get(tag)
        if found is None:
            found = self._clients[tag] = self.topology.client(tag)
        return found

    def failed(self, exc: BaseException) -> None:
        """Note a try's error: follow a ``MOVED``, or ask for a fresh map."""
        if isinstance(exc, rex.MovedError):
            self.topology.follow(exc)
            self._due = self._due or not self.topology.cluster
        elif is_redirect(exc):
            self._due = True
        elif isinstance(exc, rex.ConnectionError | rex.TimeoutError):
            self._due = self._due or self.topology.cluster


def pending(batch: Batch, routing: Routing) -> list[tuple[Any, list[Part]]]:
    """The parts of ``batch`` not yet answered, grouped by the node serving them (a client of
    that node, then its parts): one round trip each."""
    parts = batch.parts
    if len(parts) == 1:
        return [] if parts[0].done else [(routing.client(parts[0].tag), parts)]
    groups: dict[int, tuple[Any, list[Part]]] = {}
    for part in parts:
        if part.done:
            continue
        client = routing.client(part.tag)
        group = groups.get(id(client.connection_pool))
        if group is None:
            groups[id(client.connection_pool)] = (client, [part])
        else:
            group[1].append(part)
    return list(groups.values())


def packed(parts: list[Part]) -> resp.Packer | None:
    """The parts' commands as one packer (None when one of them is not packed: the shell
    queues them on a pipeline with ``queue``)."""
    for part in parts:
        if part.packer is None:
            return None
        part.count = part.packer.count
    return parts[0].packer if len(parts) == 1 else _Joined(parts)


def queue(pipe: Any, parts: list[Part]) -> None:
    """Queue the parts' commands on a redis-py pipeline, counting each part's."""
    for part in parts:
        before = len(pipe.command_stack)
        part.queue(pipe)
        part.count = len(pipe.command_stack) - before


def settle(parts: list[Part], replies: list[Any]) -> None:
    """Hand each part its replies; then raise the first part's error, if any. The others are
    answered first, so that a retry does not send them again."""
    if len(parts) == 1:  # the common case: one shard, or one per node
        parts[0].answer = parts[0].check(replies)
        parts[0].done = True
        return
    at, error = 0, None
    for part in parts:
        mine, at = replies[at : at + part.count], at + part.count
        try:
            part.answer = part.check(mine)
        except rex.RedisError as exc:
            error = error or exc
            continue
        part.done = True
    if error is not None:
        raise error


class _Joined(resp.Packer):
    """Several parts' packers as one round trip, their chunks sent as they are (uncopied)."""

    def __init__(self, parts: list[Part]) -> None:
        super().__init__()
        self._packers = [part.packer for part in parts if part.packer is not None]
        self.count = sum(packer.count for packer in self._packers)

    def chunks(self) -> list[bytes]:
        return [chunk for packer in self._packers for chunk in packer.chunks()]


# ---------------------------------------------------------------------------------------------
# Driving a plan


class CallerStopped(BaseException):
    """Raised in a streaming plan whose caller stopped iterating (closed the iterator).

    Not GeneratorExit: thrown into a plan that delegates (``yield from``), that would close the
    sub-plan, which may then not ask for its clean-up commands (map cancelling what is in
    flight). A BaseException, so that no ``except Exception`` in a plan swallows it.
    """


#: What ``Stepper.step`` returns once the plan has returned.
DONE: Any = object()


class Stepper(Generic[R]):
    """Drives one plan for a shell: ``step()`` is the plan's next step, or ``DONE`` once it has
    returned (its value then in ``result``). Before the next ``step()``, the shell hands back
    the step's answer (``answer``) or error (``fail``: raised in the plan where it yielded, so
    its ``finally`` clean-up runs, and may ask for commands of its own). A GeneratorExit (the
    shell's iterator closed) reaches the plan as ``CallerStopped``, and comes back out of
    ``step()`` as GeneratorExit once the plan has cleaned up."""

    __slots__ = ("_answer", "_error", "_plan", "result")

    def __init__(self, plan: Plan[R]) -> None:
        self._plan = plan
        self._answer: Any = None
        self._error: BaseException | None = None
        self.result: R

    def step(self) -> Any:
        answer, error = self._answer, self._error
        self._answer = self._error = None
        try:
            return self._plan.send(answer) if error is None else self._plan.throw(error)
        except StopIteration as done:
            self.result = done.value
            return DONE
        except CallerStopped:
            raise GeneratorExit from None

    def answer(self, value: Any) -> None:
        self._answer = value

    def fail(self, error: BaseException) -> None:
        self._error = CallerStopped() if isinstance(error, GeneratorExit) else error
