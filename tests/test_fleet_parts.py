"""The pieces of several models in one worker, alone: the device's turns, the session budget and
what a config read again changes."""

from __future__ import annotations

import functools
import gc
import threading
import tomllib
import weakref
from pathlib import Path

import numpy as np
import pytest
from eventually import eventually

from tools.synthetic import save
from worker.config.served import ServedConfig, parse_served
from worker.config.settings import WorkerTable
from worker.errors import ModelUnavailable
from worker.fleet.plan import plan
from worker.model.device import Device
from worker.model.held import Budget, HeldModel


def test_turns_go_by_class_then_by_arrival() -> None:
    device = Device()
    order: list[str] = []
    holding = threading.Event()
    release = threading.Event()

    def first() -> None:
        with device.turn(2):
            holding.set()
            release.wait(10)

    def wait_turn(name: str, rank: int) -> threading.Thread:
        def run() -> None:
            with device.turn(rank):
                order.append(name)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    holder = threading.Thread(target=first)
    holder.start()
    holding.wait(10)
    waiters = []
    for name, rank in [("low-a", 2), ("normal-a", 1), ("low-b", 2), ("high", 0), ("normal-b", 1)]:
        waiters.append(wait_turn(name, rank))
        count = len(waiters)
        eventually(lambda n=count: device.waiting == n, what=f"{name} waiting")
    release.set()
    for thread in [holder, *waiters]:
        thread.join(10)
    assert order == ["high", "normal-a", "normal-b", "low-a", "low-b"]
    assert device.waiting == 0


class _Session:
    """What a HeldModel needs of a session; counts its runs."""

    inputs = ()
    outputs = ()
    buckets = ()

    def __init__(self, name: str) -> None:
        self.name = name

    def padded_rows(self, rows: int) -> int:
        return rows

    def run(self, feeds: dict, names: list) -> list:
        return [np.zeros(1)]


def _held(name: str, budget: Budget, device: Device, loads: list[str], fail: bool = False):
    def load() -> _Session:
        loads.append(name)
        if fail:
            raise RuntimeError("the file is gone")
        return _Session(name)

    return HeldModel(name, _Session(name), load, budget, device)  # type: ignore[arg-type]


def test_the_budget_releases_the_least_recently_used_and_loads_on_demand() -> None:
    budget, device, loads = Budget(2), Device(), []
    a, b, c = (_held(n, budget, device, loads) for n in "abc")
    for model in (a, b, c):
        budget.start(model)
    assert budget.held == ["a", "b"]  # config order, up to the budget
    assert not c.loaded
    c.run({}, [])  # c loads; a, least recently used, goes
    assert loads == ["c"]
    assert budget.held == ["b", "c"]
    assert not a.loaded
    b.run({}, [])  # held: no load, and b is now the most recent
    a.run({}, [])  # a loads; c, now least recent, goes
    assert loads == ["c", "a"]
    assert budget.held == ["b", "a"]
    assert c.state().evictions == 1
    assert a.state().loads == 2


def test_a_released_session_is_freed() -> None:
    budget, device, loads = Budget(1), Device(), []
    a, b = (_held(n, budget, device, loads) for n in "ab")
    budget.start(a)
    budget.start(b)  # released at start
    first = weakref.ref(a._held())  # type: ignore[arg-type]
    b.run({}, [])  # a is released for b
    gc.collect()
    assert first() is None  # nothing of the worker keeps it (its memory goes with it)
    assert a.padded_rows(5) == 5  # and the model still answers what it needs without it


def test_a_model_that_cannot_load_fails_its_runs_and_is_not_retried_at_once() -> None:
    budget, device, loads = Budget(1), Device(), []
    a = _held("a", budget, device, loads)
    broken = _held("broken", budget, device, loads, fail=True)
    budget.start(a)
    budget.start(broken)
    for _ in range(3):
        with pytest.raises(ModelUnavailable, match=r"could not be loaded.*the file is gone"):
            broken.run({}, [])
    assert loads == ["broken"]  # one try; the next after RETRY_LOAD_S
    assert broken.state().error is not None
    a.run({}, [])  # the other model serves on
    assert a.loaded


def test_no_limit_holds_every_model() -> None:
    budget, device, loads = Budget(0), Device(), []
    models = [_held(n, budget, device, loads) for n in "abcd"]
    for model in models:
        budget.start(model)
    assert budget.held == list("abcd")
    budget.set_limit(1)  # a reload that lowers the budget releases the oldest at once
    assert budget.held == ["d"]


def _served(tmp_path: Path, entries: str, wide: str = "") -> ServedConfig:
    text = f'[redis]\nurl = "redis://127.0.0.1:1/0"\n{wide}\n{entries}'
    return parse_served(tomllib.loads(text), tmp_path)


def _entry(name: str, file: str = "m.onnx", version: str = "1", batch: int = 32) -> str:
    return (
        f'[[models]]\nname = "{name}"\npath = "{file}"\nversion = "{version}"\n'
        f"[models.batching]\nmax_batch_size = {batch}\n"
    )


def test_a_reload_plan_names_what_was_added_removed_and_changed(tmp_path: Path) -> None:
    save("demo", tmp_path / "m.onnx")
    save("tiny", tmp_path / "t.onnx")
    before = _served(tmp_path, _entry("a") + _entry("b") + _entry("c"))
    current = {m.model.name: (m, _sha(tmp_path / "m.onnx")) for m in before.models}
    after = _served(
        tmp_path,
        _entry("a") + _entry("b", batch=16) + _entry("d"),
        wide="[scheduling]\nmax_lanes = 8\n",
    )
    worker_now = WorkerTable(max_loaded_models=2, shared_arena=False)
    change = plan(current, after, worker_now)
    assert [c.model.name for c in change.added] == ["d"]
    assert change.removed == ("c",)
    assert [c.model.name for c in change.changed] == ["b"]
    assert change.restart_only == ("[scheduling]", "[worker] shared_arena")
    assert change.max_loaded_models == 0  # the budget applies at once
    # the worker-wide tables stay as they were, in what is applied
    assert change.changed[0].scheduling == before.models[0].scheduling


def test_a_new_file_at_the_same_path_is_a_change(tmp_path: Path) -> None:
    save("demo", tmp_path / "m.onnx")
    served = _served(tmp_path, _entry("a"))
    current = {"a": (served.models[0], _sha(tmp_path / "m.onnx"))}
    assert plan(current, served).empty
    save("tiny", tmp_path / "m.onnx")
    assert [c.model.name for c in plan(current, served).changed] == ["a"]


def _sha(path: Path) -> str:
    from worker.model.session import read_model_file

    return read_model_file(path).sha256


class _Gpu:
    """A device of ``total`` bytes where each live fake session takes ``each``."""

    def __init__(self, total: int, each: int) -> None:
        self.total, self.each, self.sessions = total, each, 0

    def free(self) -> int:
        return self.total - self.sessions * self.each


def test_on_a_gpu_the_budget_also_releases_sessions_until_the_next_load_fits() -> None:
    gpu = _Gpu(total=100, each=40)

    class _OnGpu(_Session):
        def __init__(self, name: str) -> None:
            super().__init__(name)
            gpu.sessions += 1

        def __del__(self) -> None:
            gpu.sessions -= 1

    budget, device = Budget(2), Device()
    models = []
    for name in "abc":
        first = _OnGpu(name)
        load = functools.partial(_OnGpu, name)
        held = HeldModel(name, first, load, budget, device, device_memory=gpu.free, device_bytes=40)  # type: ignore[arg-type]
        models.append(held)
        del first
    a, b, c = models
    for model in models:
        budget.start(model)  # a and b held, c released: two sessions of 40 on a device of 100
    budget.set_limit(0)  # a reload lifts the count limit: memory alone bounds it now
    gc.collect()
    assert gpu.free() == 20
    c.run({}, [])  # 20 free < 40 x 1.25: a, least recently used, goes first
    gc.collect()
    assert not a.loaded
    assert b.loaded
    assert c.loaded
    assert gpu.free() == 20
    assert c.state().device_bytes == 40  # measured again on this load
