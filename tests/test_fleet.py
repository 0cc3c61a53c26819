"""Several models in one worker (contract section 8): each answered right, a session budget with
load on demand, one device for all, and new versions swapped in on SIGHUP without a restart."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import redis
from eventually import eventually
from harness import PREFIX, direct_run, running_fleet, send, wait_reply

from producer.protocol.codec import decode_reply
from producer.protocol.keys import reply_key, worker_key
from tools import synthetic
from worker.ops.metrics import MetricsServer

MODELS = {  # name: (synthetic model, its inputs for ``rows`` rows)
    "demo": (lambda: synthetic.demo(7), lambda g, n: {"features": g.normal(size=(n, 16))}),
    "demo2": (lambda: synthetic.demo(8), lambda g, n: {"features": g.normal(size=(n, 16))}),
    "tiny": (synthetic.tiny, lambda g, n: {"x": g.normal(size=(n, 128))}),
    "multi": (
        synthetic.multi_io,
        lambda g, n: {"a": g.normal(size=(n, 3)), "b": g.integers(-9, 9, size=(n, 2))},
    ),
}


def _inputs(name: str, rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    made = MODELS[name][1](rng, rows)
    return {k: v.astype(np.float32 if v.dtype.kind == "f" else np.int64) for k, v in made.items()}


def _entry(name: str, file: str, version: str = "1") -> str:
    return f"""
[[models]]
name = "{name}"
path = "{file}"
version = "{version}"
providers = ["cpu"]
[models.batching]
max_batch_size = 16
max_wait_ms = 5
[models.warmup]
runs = 1
"""


def _write(where: Path, url: str, entries: list[str], budget: int = 0) -> Path:
    config = where / "worker.toml"
    head = f'[redis]\nurl = "{url}"\nprefix = "{PREFIX}"\n\n'
    head += f"[worker]\nmax_loaded_models = {budget}\n"
    config.write_text(head + "".join(entries))
    return config


def _models(where: Path, names: list[str]) -> dict[str, Path]:
    paths = {}
    for name in names:
        paths[name] = where / f"{name}.onnx"
        onnx.save(MODELS[name][0](), paths[name])
    return paths


def _record(rconn: redis.Redis, model: str, name: str = "w1") -> dict:
    """The worker's record of ``model`` ({} in the moment a swap replaces it)."""
    raw = rconn.get(worker_key(PREFIX, model, name))
    return {} if raw is None else json.loads(raw)


def _version(rconn: redis.Redis) -> str | None:
    return _record(rconn, "demo").get("model", {}).get("version")


def test_four_models_in_one_worker_each_answered_right_under_a_budget_of_two(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    names = ["demo", "demo2", "tiny", "multi"]
    paths = _models(tmp_path, names)
    config = _write(tmp_path, redis_url, [_entry(n, paths[n].name) for n in names], budget=2)
    rng = np.random.default_rng(3)
    with running_fleet(config) as fleet:
        # At start, the first two in config order are held and the others released
        assert fleet.budget.held == ["demo", "demo2"]
        eventually(lambda: _record(rconn, "tiny")["session"]["loaded"] is False, what="record")
        server = MetricsServer(fleet.metrics, fleet.ready, 0, host="127.0.0.1")  # type: ignore[arg-type]
        server.start()
        try:
            for turn in range(12):  # round-robin: every request after the first two evicts one
                name = names[turn % 4]
                inputs = _inputs(name, rng, 1 + turn % 3)
                reply = wait_reply(rconn, send(rconn, name, f"{name}-{turn}", inputs))
                assert reply.ok, reply.error
                assert reply.model.name == name
                expected = direct_run(paths[name], inputs)
                for out, value in expected.items():
                    np.testing.assert_allclose(reply.outputs[out], value, rtol=1e-5, atol=1e-6)
                assert len(fleet.budget.held) <= 2
            import urllib.request

            text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
        finally:
            server.close()
        eventually(
            lambda: _record(rconn, "demo")["session"]["loads"] >= 3, what="the record's loads"
        )
        assert _record(rconn, "demo")["session"]["evictions"] >= 2
    for name in names:  # one family, a series per model
        assert f'redbatch_model_loaded{{model="{name}"}}' in text
        assert f'redbatch_requests_total{{code="OK",model="{name}"}} 3.0' in text
    process = [line for line in text.splitlines() if line.startswith("process_cpu_seconds_total")]
    assert len(process) == 1  # the process's series given once, without a model


def test_a_backlog_on_one_model_does_not_hold_up_another(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    names = ["tiny", "demo"]
    paths = _models(tmp_path, names)
    config = _write(tmp_path, redis_url, [_entry(n, paths[n].name) for n in names])
    rng = np.random.default_rng(4)
    backlog = 4000
    with running_fleet(config):
        pipe = rconn.pipeline(transaction=False)
        body = _inputs("tiny", rng, 1)
        for i in range(backlog):
            send(pipe, "tiny", f"t{i}", body)
        pipe.execute()
        # A request to the other model is answered while most of the backlog still waits
        reply = wait_reply(rconn, send(rconn, "demo", "d0", _inputs("demo", rng, 1)))
        assert reply.ok, reply.error
        left = rconn.xlen(f"{PREFIX}:{{tiny}}:requests")
        answered = sum(
            rconn.exists(reply_key(PREFIX, "tiny", f"t{i}")) for i in range(0, backlog, 50)
        )
        assert answered < backlog // 50 // 2, (answered, left)
        wait_reply(rconn, f"t{backlog - 1}", timeout_s=60)


def test_a_new_version_is_swapped_in_under_load_and_each_reply_names_what_ran_it(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    paths = _models(tmp_path, ["demo", "demo2"])
    config = _write(tmp_path, redis_url, [_entry("demo", "demo.onnx", "1")])
    rng = np.random.default_rng(5)
    sent: dict[str, dict[str, np.ndarray]] = {}
    swapped = threading.Event()
    with running_fleet(config) as fleet:

        def load() -> None:
            i = 0
            while not swapped.is_set() or (i < len(sent) + 200 and i < 3000):
                inputs = _inputs("demo", rng, 1 + i % 4)
                sent[send(rconn, "demo", f"s{i}", inputs)] = inputs
                i += 1
                if i % 50 == 0:
                    time.sleep(0.005)  # a steady stream, not one burst

        sender = threading.Thread(target=load)
        sender.start()
        eventually(lambda: len(sent) > 300, what="load under way")
        readiness: list[bool] = []

        def watch_ready() -> None:  # /readyz's answer, all through the swap
            while not swapped.is_set():
                readiness.append(fleet.ready())
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch_ready)
        watcher.start()
        _write(tmp_path, redis_url, [_entry("demo", "demo2.onnx", "2")])
        fleet.request_reload()
        eventually(lambda: _version(rconn) == "2", what="version 2 serving")
        eventually(lambda: fleet.slots["demo"].worker.ready.is_set(), what="v2 reads")  # noqa: PLW0108 (the slot is replaced)
        swapped.set()
        watcher.join()
        assert readiness
        assert all(readiness)  # ready all through: reading stops only for a moment
        sender.join()
        versions: dict[str, int] = {"1": 0, "2": 0}
        for rid, inputs in sent.items():
            key = reply_key(PREFIX, "demo", rid)
            eventually(lambda key=key: rconn.exists(key), timeout_s=30, what=f"reply {rid}")
            assert rconn.llen(key) == 1  # answered once
            reply = decode_reply(rconn.lindex(key, 0))
            assert reply.ok, reply.error
            version = reply.model.version
            versions[version] += 1
            expected = direct_run(paths["demo" if version == "1" else "demo2"], inputs)
            np.testing.assert_allclose(reply.outputs["probs"], expected["probs"], rtol=1e-5)
    assert versions["1"] > 0
    assert versions["2"] > 0


def test_a_version_that_cannot_load_leaves_the_old_one_serving_and_reload_says_why(
    tmp_path: Path, redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    from producer.cli.main import main as redbatch

    _models(tmp_path, ["demo"])
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    config = _write(tmp_path, redis_url, [_entry("demo", "demo.onnx", "1")])
    rng = np.random.default_rng(6)
    with running_fleet(config):
        _write(tmp_path, redis_url, [_entry("demo", "broken.onnx", "2")])
        # The operator command, by the worker's name: the ask goes through Redis
        assert redbatch(["reload", "--model", "demo", "w1", "--redis-url", redis_url]) == 1
        out = capsys.readouterr().out
        assert "w1 read its config again" in out
        assert "not applied: version '2' of 'demo' not loaded" in out
        assert "broken.onnx" in out
        assert "version '1' serves on" in out
        assert _record(rconn, "demo")["reload"]["errors"]
        reply = wait_reply(rconn, send(rconn, "demo", "after", _inputs("demo", rng, 2)))
        assert reply.ok, reply.error
        assert reply.model.version == "1"
        # Fixed, and asked again: the new version serves
        _write(tmp_path, redis_url, [_entry("demo", "demo.onnx", "3")])
        assert redbatch(["reload", "--model", "demo", "w1", "--redis-url", redis_url]) == 0
        assert "changed demo@3" in capsys.readouterr().out
        reply = wait_reply(rconn, send(rconn, "demo", "fixed", _inputs("demo", rng, 2)))
        assert reply.model.version == "3"
    assert redbatch(["reload", "--model", "demo", "w1", "--redis-url", redis_url]) == 1
    assert "no live worker named 'w1'" in capsys.readouterr().out


def test_sighup_to_the_worker_process_swaps_the_version(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    import os
    import signal
    import subprocess
    import sys

    _models(tmp_path, ["demo", "demo2"])
    config = _write(tmp_path, redis_url, [_entry("demo", "demo.onnx", "1")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "--config", str(config), "--name", "hup"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        eventually(lambda: _record(rconn, "demo", "hup"), timeout_s=60, what="worker up")
        _write(tmp_path, redis_url, [_entry("demo", "demo2.onnx", "2")])
        os.kill(proc.pid, signal.SIGHUP)
        eventually(
            lambda: _record(rconn, "demo", "hup").get("model", {}).get("version") == "2",
            timeout_s=30,
            what="version 2",
        )
        reply = wait_reply(
            rconn, send(rconn, "demo", "h1", _inputs("demo", np.random.default_rng(1), 1))
        )
        assert reply.model.version == "2"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"model swapped" in err


def test_models_added_and_removed_on_reload(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    _models(tmp_path, ["demo", "tiny"])
    config = _write(tmp_path, redis_url, [_entry("demo", "demo.onnx")])
    rng = np.random.default_rng(7)
    with running_fleet(config) as fleet:
        _write(tmp_path, redis_url, [_entry("tiny", "tiny.onnx")])
        fleet.request_reload()
        eventually(lambda: set(fleet.slots) == {"tiny"}, what="demo dropped, tiny added")
        eventually(fleet.ready, what="tiny ready")
        assert wait_reply(rconn, send(rconn, "tiny", "t", _inputs("tiny", rng, 1))).ok
        assert rconn.get(worker_key(PREFIX, "demo", "w1")) is None  # its record removed


def test_a_file_replaced_under_a_released_model_is_refused_per_request_not_served(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    paths = _models(tmp_path, ["demo", "tiny", "demo2"])
    config = _write(
        tmp_path, redis_url, [_entry("demo", "demo.onnx"), _entry("tiny", "tiny.onnx")], budget=1
    )
    rng = np.random.default_rng(8)
    with running_fleet(config):
        assert wait_reply(rconn, send(rconn, "tiny", "t1", _inputs("tiny", rng, 1))).ok
        paths["demo"].write_bytes(paths["demo2"].read_bytes())  # released, then replaced
        reply = wait_reply(rconn, send(rconn, "demo", "d1", _inputs("demo", rng, 1)))
        assert reply.error is not None
        assert reply.error.code == "INTERNAL"
        assert reply.error.retryable
        assert "changed since it was loaded" in reply.error.message
        assert "SIGHUP" in reply.error.message
        assert wait_reply(rconn, send(rconn, "tiny", "t2", _inputs("tiny", rng, 1))).ok
        eventually(lambda: _record(rconn, "demo")["session"]["error"], what="the load's error")


@pytest.mark.parametrize("budget", [1, 3])
def test_check_prints_every_models_record(tmp_path: Path, budget: int, capsys) -> None:
    from worker.cli import main

    names = ["demo", "tiny", "multi"]
    _models(tmp_path, names)
    config = _write(tmp_path, "redis://127.0.0.1:1/0", [_entry(n, f"{n}.onnx") for n in names])
    config.write_text(config.read_text().replace("= 0", f"= {budget}", 1))
    assert main(["--config", str(config), "--check"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["model"]["name"] for r in records] == names


def test_a_changed_config_file_is_applied_when_watched(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    # As a Kubernetes ConfigMap changes: the file is replaced in place, and no signal comes
    _models(tmp_path, ["demo", "demo2"])
    config = _write(tmp_path, redis_url, [_entry("demo", "demo.onnx", "1")])
    with running_fleet(config, watch_s=0.05):
        config.write_text(config.read_text())  # unchanged bytes: nothing happens
        staged = tmp_path / "staged.toml"
        new = _entry("demo", "demo2.onnx", "2")
        staged.write_text(config.read_text().split("[[models]]")[0] + new.lstrip())
        staged.replace(config)  # an atomic swap, as the kubelet's
        eventually(lambda: _version(rconn) == "2", what="version 2 serving")
        reply = wait_reply(
            rconn, send(rconn, "demo", "w1", _inputs("demo", np.random.default_rng(2), 1))
        )
        assert reply.model.version == "2"


def test_status_shows_every_model_a_worker_serves_held_or_not(
    tmp_path: Path, redis_url: str, rconn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    from producer.cli.main import main as redbatch

    _models(tmp_path, ["demo", "tiny"])
    config = _write(
        tmp_path, redis_url, [_entry("demo", "demo.onnx"), _entry("tiny", "tiny.onnx")], budget=1
    )
    with running_fleet(config):
        assert wait_reply(
            rconn, send(rconn, "tiny", "t", _inputs("tiny", np.random.default_rng(3), 1))
        ).ok
        eventually(
            lambda: _record(rconn, "demo").get("session", {}).get("loaded") is False,
            what="demo released",
        )
        eventually(
            lambda: _record(rconn, "tiny").get("session", {}).get("loaded") is True,
            what="tiny held",
        )
        base = ["--redis-url", redis_url]
        assert redbatch([*base, "status", "--worker", "w1"]) == 0
        text = capsys.readouterr().out
        assert "Worker w1 serves 2 models" in text
        rows = {line.split()[0]: line.split() for line in text.splitlines()[2:4]}
        assert rows["demo"][3] == "released"
        assert rows["tiny"][3] == "held"
        assert redbatch([*base, "status", "--worker", "w1", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert {m["model"]: m["session"]["loaded"] for m in listed} == {"demo": False, "tiny": True}
        assert redbatch([*base, "status", "--model", "demo"]) == 0
        assert "session released (loads on its next request)" in capsys.readouterr().out
    assert redbatch([*base, "status", "--worker", "w1"]) == 1
    assert "no live worker named 'w1'" in capsys.readouterr().out


def test_released_and_replaced_sessions_are_freed_even_with_start_up_frozen(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    import gc
    import weakref

    _models(tmp_path, ["demo", "tiny", "demo2"])
    config = _write(
        tmp_path, redis_url, [_entry("demo", "demo.onnx"), _entry("tiny", "tiny.onnx")], budget=1
    )
    rng = np.random.default_rng(9)
    with running_fleet(config) as fleet:
        demo = weakref.ref(fleet.slots["demo"].held._held())  # type: ignore[arg-type]
        gc.freeze()  # as the CLI does after start-up: nothing of it is collected by cycles
        try:
            # An eviction: tiny's load releases demo's session
            assert wait_reply(rconn, send(rconn, "tiny", "t1", _inputs("tiny", rng, 1))).ok
            assert demo() is None
            # A swap: the old version's session goes once it has drained
            tiny = weakref.ref(fleet.slots["tiny"].held._held())  # type: ignore[arg-type]
            _write(
                tmp_path,
                redis_url,
                [_entry("demo", "demo.onnx"), _entry("tiny", "demo2.onnx", "2")],
                budget=1,
            )
            fleet.request_reload()
            eventually(
                lambda: _record(rconn, "tiny").get("model", {}).get("version") == "2", what="v2"
            )
            assert tiny() is None
        finally:
            gc.unfreeze()


def test_a_worker_of_two_models_killed_mid_stream_loses_nothing_and_answers_once(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    import os
    import signal
    import subprocess
    import sys

    # Given two worker processes, each serving demo and tiny, a short claim_idle_ms
    paths = _models(tmp_path, ["demo", "tiny"])
    fast_claim = "[models.delivery]\nclaim_idle_ms = 500\n"
    config = _write(
        tmp_path,
        redis_url,
        [_entry("demo", "demo.onnx") + fast_claim, _entry("tiny", "tiny.onnx") + fast_claim],
    )

    def start(name: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", "--config", str(config), "--name", name],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    victim, survivor = start("wA"), start("wB")
    try:
        for name in ("wA", "wB"):
            for model in ("demo", "tiny"):
                eventually(lambda m=model, n=name: _record(rconn, m, n), 60, f"{name} {model}")
        # When requests to both models stream in and one worker is SIGKILLed among them
        rng = np.random.default_rng(10)
        sent: dict[str, tuple[str, dict[str, np.ndarray]]] = {}
        held = 0
        for i in range(1200):
            model = "demo" if i % 2 else "tiny"
            inputs = _inputs(model, rng, 1 + i % 3)
            sent[send(rconn, model, f"k{i}", inputs)] = (model, inputs)
            # killed, from the 400th on, at a moment it holds requests read and not answered
            if i >= 400 and not held and (held := _held_by(rconn, "wA")):
                os.kill(victim.pid, signal.SIGKILL)
        # Then every request is answered exactly once, right, by the workers between them
        for rid, (model, inputs) in sent.items():
            key = reply_key(PREFIX, model, rid)
            eventually(lambda key=key: rconn.exists(key), timeout_s=60, what=f"reply {rid}")
            assert rconn.llen(key) == 1
            reply = decode_reply(rconn.lindex(key, 0))
            assert reply.ok, reply.error
            expected = direct_run(paths[model], inputs)
            for out, value in expected.items():
                np.testing.assert_allclose(reply.outputs[out], value, rtol=1e-5, atol=1e-6)
        assert victim.wait(10) == -signal.SIGKILL
        assert held > 0  # what it held was claimed and answered by the other
        assert _held_by(rconn, "wA") == 0
    finally:
        for proc in (victim, survivor):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    assert survivor.returncode == 0


def _held_by(rconn: redis.Redis, consumer: str) -> int:
    """Entries read by ``consumer`` and not yet answered, over both models' streams."""
    held = 0
    for model in ("demo", "tiny"):
        summary = rconn.xpending(f"{PREFIX}:{{{model}}}:requests", "workers")
        for entry in summary.get("consumers") or []:
            name = entry["name"].decode() if isinstance(entry["name"], bytes) else entry["name"]
            held += int(entry["pending"]) if name == consumer else 0
    return held
