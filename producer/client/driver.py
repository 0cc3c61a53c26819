"""What both shells' drivers share: the ``Stepper`` that steps a plan, and the grouping of a
``Batch``'s parts into one round trip per node.

The shell groups a batch's parts by node at each try: on a single Redis every part goes in one
round trip; on a cluster each node gets its own. A part that succeeded is not sent again when
another part's node failed and the batch is retried.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import redis.exceptions as rex

from producer.client.routing import Routing
from producer.client.steps import Batch, Part, Plan
from producer.redisio import resp

__all__ = ["DONE", "CallerStopped", "Stepper", "packed", "pending", "queue", "settle"]

R = TypeVar("R")


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
    its ``finally`` clean-up runs, and may ask for commands of its own), or a plan whose steps
    take the step's place (``enter``: the blocking shell's ``Send`` is ``plans.send``), as
    ``yield from`` would. A GeneratorExit (the shell's iterator closed) reaches the plan as
    ``CallerStopped``, and comes back out of ``step()`` as GeneratorExit once the plan has
    cleaned up."""

    __slots__ = ("_answer", "_error", "_plans", "result")

    def __init__(self, plan: Plan[R]) -> None:
        self._plans: list[Plan[Any]] = [plan]  # the plan, then the sub-plans it is in
        self._answer: Any = None
        self._error: BaseException | None = None
        self.result: R

    def step(self) -> Any:
        answer, error = self._answer, self._error
        self._answer = self._error = None
        plans = self._plans
        while True:
            plan = plans[-1]
            try:
                return plan.send(answer) if error is None else plan.throw(error)
            except StopIteration as done:
                plans.pop()
                if not plans:
                    self.result = done.value
                    return DONE
                answer, error = done.value, None  # what a sub-plan returns answers its step
            except BaseException as exc:
                if len(plans) == 1:
                    if isinstance(exc, CallerStopped):
                        raise GeneratorExit from None
                    raise
                plans.pop()
                answer, error = None, exc  # a sub-plan's error is its step's

    def answer(self, value: Any) -> None:
        self._answer = value

    def fail(self, error: BaseException) -> None:
        self._error = CallerStopped() if isinstance(error, GeneratorExit) else error

    def enter(self, plan: Plan[Any]) -> None:
        """Run ``plan`` in place of the step: its steps come next, and what it returns (or
        raises) is the step's answer (or error)."""
        self._plans.append(plan)
