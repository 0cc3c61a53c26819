"""What a plan (``producer.plans``) asks of the shell that runs it, and the ``Stepper`` that
drives a plan for either shell.

A plan yields steps: ``Call`` (one redis-py command), ``Batch`` (many commands in one round
trip) or ``Sleep``. The shell takes each step, blocking (``Client``) or awaiting
(``AsyncClient``), through the step's retry policy, and hands the ``Stepper`` the answer or
the error, which the plan gets back where it yielded.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from producer import resp
from producer.retry import RetryPolicy

__all__ = ["DONE", "Batch", "Call", "CallerStopped", "Plan", "Sleep", "Step", "Stepper"]

R = TypeVar("R")

#: A plan: yields steps (and, when it streams, outputs), is sent answers, returns ``R``.
Plan = Generator[Any, Any, R]


@dataclass(eq=False, slots=True)
class Call:
    """One redis-py command, ``fn(redis)`` on the shell's client (the asyncio shell awaits what it
    returns), tried through ``retry``; ``tries`` counts the tries the shell made."""

    name: str  # the Redis command, for tests and debugging
    fn: Callable[[Any], Any]
    retry: RetryPolicy
    tries: int = 0


@dataclass(eq=False, slots=True)
class Batch:
    """Many commands in one round trip, tried through ``retry``: hand-packed (``packer``, its
    replies checked by ``check``) on a client with an ordinary pool, else queued by ``queue`` on
    a new redis-py pipeline per try (a failed ``execute()`` has already emptied the old one)."""

    name: str
    retry: RetryPolicy
    queue: Callable[[Any], None]
    packer: resp.Packer | None = None
    check: Callable[[list[Any]], Any] = resp.raise_first_error
    tries: int = 0


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds`` before the next step (Redis has no event for a stream shrinking)."""

    seconds: float


#: What a shell runs: the commands a plan yields.
Step = Call | Batch | Sleep


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
