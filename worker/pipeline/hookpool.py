"""The threads a pipeline's hooks run on, each call bounded in time.

Hooks are the user's Python: image decoding, tokenizing. They run on ``pipeline.threads``
threads of their own, off the reading thread and the model's, so that decoding the next read
overlaps the current run (Pillow, numpy and tokenizers release the GIL in their heavy parts).

Python cannot stop a thread, so a hook that hangs is bounded this way: the caller waits at most
``pipeline.timeout_s`` from the moment the call started, then answers its requests
``INFERENCE_FAILED`` and moves on; the hung thread is abandoned and a new one takes its place,
so the pool keeps its size. Abandoned threads are counted (``stuck``); once as many are stuck
as the pool has threads the worker reports itself unhealthy, and its orchestrator restarts it.
Each call's wall time and the CPU time of its thread are measured, which is how ``/metrics``
tells whether the worker is bound by preprocessing or by the model.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Call", "HookPool", "HookTimeout"]

log = logging.getLogger(__name__)

_WAIT_UNSTARTED_S = 0.05  # how often a waiter looks again at a call not started yet


class HookTimeout(Exception):
    """Raised (as a call's result) when a hook ran past ``pipeline.timeout_s``."""


@dataclass(slots=True)
class Call:
    """One hook call on the pool: its result or exception, and what it cost."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    label: str = "a pipeline hook"  # how errors and logs name it: "preprocess"
    future: Future[Any] = field(default_factory=Future)
    started: float | None = None  # monotonic, once a thread took it
    wall_s: float = 0.0
    cpu_s: float = 0.0
    abandoned: bool = False


class HookPool:
    """``threads`` threads running hook calls; ``stuck`` counts the ones abandoned."""

    def __init__(self, threads: int, timeout_s: float, name: str = "redbatch-hook") -> None:
        self.threads = threads
        self.timeout_s = timeout_s
        self.name = name
        self.stuck = 0
        self.running = 0  # calls a thread is running now, hung ones included
        # (priority, order, call): postprocess calls, which the model's thread waits on, go
        # before queued preprocess calls, which only the next batches wait on.
        self._calls: queue.PriorityQueue[tuple[int, int, Call | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._started = 0
        for _ in range(threads):
            self._start_thread()

    def submit(
        self, fn: Callable[..., Any], *args: Any, urgent: bool = False, label: str = ""
    ) -> Call:
        """Queue ``fn(*args)``; an ``urgent`` call goes before every queued ordinary one."""
        call = Call(fn, args, label or "a pipeline hook")
        self._calls.put((0 if urgent else 1, next(self._order), call))
        return call

    def wait(self, calls: Sequence[Call]) -> None:
        """Wait for every call; one past its time limit gets ``HookTimeout`` as its result."""
        for call in calls:
            self._wait_one(call)

    def close(self) -> None:
        """Let the live threads end once the calls before this are done."""
        for _ in range(self.threads):
            self._calls.put((2, next(self._order), None))

    @property
    def busy(self) -> bool:
        """Whether a call that has not hung is running now (the worker is moving)."""
        return self.running > self.stuck

    @property
    def healthy(self) -> bool:
        """False once as many threads hang as the pool has (a restart is the cure)."""
        return self.stuck < self.threads

    def _wait_one(self, call: Call) -> None:
        future = call.future
        while not future.done():
            started = call.started
            if started is None:
                _settle(future, _WAIT_UNSTARTED_S)
                continue
            left = started + self.timeout_s - time.monotonic()
            if left > 0:
                _settle(future, left)
                continue
            self._abandon(call)
            return

    def _abandon(self, call: Call) -> None:
        with self._lock:
            if call.future.done():
                return
            call.abandoned = True
            self.stuck += 1
            call.future.set_exception(
                HookTimeout(
                    f"{call.label} did not return within pipeline.timeout_s = "
                    f"{self.timeout_s:g} s; its thread was abandoned"
                )
            )
        log.error(
            "a pipeline hook hung; its requests are answered INFERENCE_FAILED and a new "
            "thread takes its place",
            extra={"fields": {"hook": call.label, "stuck_threads": self.stuck}},
        )
        self._start_thread()

    def _start_thread(self) -> None:
        self._started += 1
        thread = threading.Thread(target=self._serve, name=f"{self.name}-{self._started}")
        thread.daemon = True  # a hung hook must not keep the process from exiting
        thread.start()

    def _serve(self) -> None:
        while (call := self._calls.get()[2]) is not None:
            call.started = time.monotonic()
            cpu = time.thread_time()
            with self._lock:
                self.running += 1
            try:
                result = call.fn(*call.args)
            except BaseException as exc:  # the hook's own: every error is its request's
                outcome: tuple[bool, Any] = (False, exc)
            else:
                outcome = (True, result)
            finally:
                with self._lock:
                    self.running -= 1
            call.cpu_s = time.thread_time() - cpu
            call.wall_s = time.monotonic() - call.started
            with self._lock:
                if call.abandoned:  # it came back after all: a replacement already serves
                    self.stuck -= 1
                    return
                if outcome[0]:
                    call.future.set_result(outcome[1])
                else:
                    call.future.set_exception(outcome[1])


def _settle(future: Future[Any], timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        future.exception(timeout=timeout_s)
