"""Pipelines end to end (contract 6): a handler written from the contract alone, with plain
dicts and no import of this project, loaded next to its config, run by a real worker."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import redis
from harness import running_worker, send, stream_is_empty, wait_reply, write_config

from worker.config import load_config
from worker.errors import ConfigError
from worker.service import prepare

# The model multi_io: a float32 [N,3], b int64 [N,2] -> twice float32 [N,3], total int64 [N].
HANDLER = '''
import threading
import time

import numpy as np

HANG = threading.Event()


class Numbers:
    """Raw rows of "x,y,z" text to the model's a and b; sums and words back."""

    inputs = {"text": {"dtype": "string", "shape": [-1]}}
    outputs = {"sum": {"dtype": "float32", "shape": [-1]},
               "word": {"dtype": "string", "shape": [-1]}}

    def __init__(self, scale=1.0):
        self.scale = scale

    def preprocess(self, inputs):
        rows = []
        for text in inputs["text"]:
            if text == "boom":
                raise RuntimeError("the hook broke")
            if text == "hang":
                HANG.wait(30)
            if text == "wrong-dtype":
                return {"a": np.zeros((1, 3)), "b": np.zeros((1, 2), np.int64)}
            if text in ("nan", "post-boom", "surrogate"):
                rows.append([float("nan") if text == "nan" else 1.0] * 3)
                continue
            try:
                rows.append([float(v) * self.scale for v in text.split(",")])
            except ValueError:
                raise ValueError(f"row {text!r} is not three numbers separated by commas")
            if len(rows[-1]) != 3:
                raise ValueError(f"row {text!r} has {len(rows[-1])} numbers, not 3")
        a = np.array(rows, np.float32)
        return {"a": a, "b": np.zeros((len(rows), 2), np.int64)}

    def postprocess(self, outputs, inputs):
        total = outputs["twice"].sum(axis=1)
        if any(t == "post-boom" for t in inputs["text"]):
            raise KeyError("post")
        if any(t == "surrogate" for t in inputs["text"]):
            return {"sum": total.astype(np.float32), "word": np.array(["\\ud800"], dtype=object)}
        words = np.array(["big" if v > 10 else "small" for v in total], dtype=object)
        return {"sum": total.astype(np.float32), "word": words}

    def warmup_inputs(self):
        return {"text": np.array(["1,2,3"], dtype=object)}
'''

PIPELINE = """
[pipeline]
handler = "numbers_handler:Numbers"
threads = 2
timeout_s = 1.0
[pipeline.options]
scale = 2.0
"""


@pytest.fixture
def config(tmp_path: Path, redis_url: str) -> Path:
    (tmp_path / "numbers_handler.py").write_text(textwrap.dedent(HANDLER))
    return write_config(tmp_path, "multi_io", redis_url, extra=PIPELINE)


def _text(*rows: str) -> dict[str, np.ndarray]:
    return {"text": np.array(list(rows), dtype=object)}


def test_requests_are_preprocessed_run_and_postprocessed(config: Path, rconn: redis.Redis) -> None:
    with running_worker(config) as worker:
        assert not worker.batcher.split  # hooks take requests whole (worker/answer/parts.py)
        send(rconn, "multi_io", "r1", _text("1,2,3", "4,5,6"))
        reply = wait_reply(rconn, "r1")
    assert reply.ok, reply.error
    assert reply.outputs is not None
    # scale 2 from [pipeline.options], twice from the model: sum of 4 * row
    np.testing.assert_allclose(reply.outputs["sum"], [24.0, 60.0])
    assert list(reply.outputs["word"]) == ["big", "big"]
    assert reply.model.pipeline is not None
    assert reply.model.pipeline.handler == "numbers_handler:Numbers"
    assert len(reply.model.pipeline.sha256) == 64
    assert {"preprocess", "postprocess", "queued", "inference"} <= set(reply.timings_ms)


def test_each_hook_failure_answers_its_request_alone(config: Path, rconn: redis.Redis) -> None:
    cases = {
        "bad": ("x,y", "INVALID_INPUT", "not three numbers"),
        "boom": ("boom", "INFERENCE_FAILED", "RuntimeError: the hook broke"),
        "dtype": ("wrong-dtype", "INFERENCE_FAILED", "expected dtype float32, got float64"),
        "nan": ("nan", "INFERENCE_FAILED", "not finite"),
        "post": ("post-boom", "INFERENCE_FAILED", "postprocess raised KeyError"),
        "surrogate": ("surrogate", "INFERENCE_FAILED", "not valid Unicode"),
    }
    with running_worker(config):
        # the bad requests and good ones interleaved, so that they share reads and batches
        for rid, (text, _, _) in cases.items():
            send(rconn, "multi_io", f"ok-{rid}", _text("1,1,1"))
            send(rconn, "multi_io", rid, _text(text))
        replies = {rid: wait_reply(rconn, rid) for rid in cases}
        good = [wait_reply(rconn, f"ok-{rid}") for rid in cases]
        assert stream_is_empty(rconn, "multi_io")
    for rid, (_, code, words) in cases.items():
        reply = replies[rid]
        assert not reply.ok
        assert reply.error is not None
        assert reply.error.code == code, (rid, reply.error)
        assert words in reply.error.message, (rid, reply.error.message)
    for reply in good:
        assert reply.ok, reply.error
        assert reply.outputs is not None
        np.testing.assert_allclose(reply.outputs["sum"], [12.0])


def test_raw_inputs_are_checked_against_the_handler_before_any_hook(
    config: Path, rconn: redis.Redis
) -> None:
    with running_worker(config):
        send(rconn, "multi_io", "numeric", {"text": np.zeros((1,), np.float32)})
        send(rconn, "multi_io", "bytes", {"text": [b"1,2,3"]})
        send(rconn, "multi_io", "unknown", {"other": ["1,2,3"]})
        send(rconn, "multi_io", "outputs", _text("1,2,3"), outputs=["nope"])
        send(rconn, "multi_io", "only-word", _text("1,2,3"), outputs=["word"])
        replies = {rid: wait_reply(rconn, rid) for rid in ("numeric", "bytes", "unknown")}
        unknown_output = wait_reply(rconn, "outputs")
        only_word = wait_reply(rconn, "only-word")
    assert replies["numeric"].error is not None
    assert "expected dtype string, got float32" in replies["numeric"].error.message
    assert replies["bytes"].error is not None
    assert "expected dtype string, got bytes" in replies["bytes"].error.message
    assert replies["unknown"].error is not None
    assert "unknown input 'other'" in replies["unknown"].error.message
    assert unknown_output.error is not None
    assert unknown_output.error.code == "INVALID_INPUT"
    assert "'nope'" in unknown_output.error.message
    assert only_word.outputs is not None
    assert set(only_word.outputs) == {"word"}


def test_a_hook_that_hangs_is_bounded_and_the_worker_serves_on(
    config: Path, rconn: redis.Redis
) -> None:
    with running_worker(config) as worker:
        hang = __import__("numbers_handler").HANG
        try:
            send(rconn, "multi_io", "hang", _text("hang"))
            reply = wait_reply(rconn, "hang")
            send(rconn, "multi_io", "after", _text("1,2,3"))
            after = wait_reply(rconn, "after")
            assert worker.pipeline is not None
            assert worker.pipeline.pool.stuck == 1
            assert worker.healthy()  # one of two threads stuck: still serving
        finally:
            hang.set()
    assert reply.error is not None
    assert reply.error.code == "INFERENCE_FAILED"
    assert "preprocess did not return within pipeline.timeout_s = 1 s" in reply.error.message
    assert after.ok


def test_a_hook_that_raises_on_every_request_does_not_stop_the_worker(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    (tmp_path / "numbers_handler.py").write_text(textwrap.dedent(HANDLER))
    config = write_config(tmp_path, "multi_io", redis_url, extra=PIPELINE)
    with running_worker(config):
        for i in range(40):
            send(rconn, "multi_io", f"b{i}", _text("boom"))
        codes = {wait_reply(rconn, f"b{i}").error.code for i in range(40)}  # type: ignore[union-attr]
        send(rconn, "multi_io", "fine", _text("1,2,3"))
        assert wait_reply(rconn, "fine").ok
    assert codes == {"INFERENCE_FAILED"}


def test_the_validation_record_names_the_handler_its_source_and_options(config: Path) -> None:
    prepared = prepare(load_config(config), "w")
    record = prepared.record["pipeline"]
    assert record["handler"] == "numbers_handler:Numbers"
    assert record["source"].endswith("numbers_handler.py")
    assert record["options"] == {"scale": 2.0}
    assert record["inputs"] == [{"name": "text", "dtype": "string", "shape": [-1]}]
    assert prepared.record["warmup"]["pipeline"]["requests"] == [1, 32]
    assert prepared.pipeline is not None
    prepared.pipeline.pool.close()


@pytest.mark.parametrize(
    ("handler", "source", "words"),
    [
        ("missing_mod:X", None, "no module 'missing_mod'"),
        ("h:Nope", "class X: pass", "has no attribute 'Nope'"),
        ("h:X", "class X:\n    def __init__(self): raise OSError('no file')", "OSError: no file"),
        ("h:X", "class X:\n    inputs = {'a': {'dtype': 'f32', 'shape': [-1]}}", "dtype 'f32'"),
        (
            "h:X",
            "class X:\n    inputs = {'a': {'dtype': 'bytes', 'shape': [-1]}}\n"
            "    def preprocess(self, i): return i",
            "no warmup_inputs()",
        ),
        ("h:X", "class X:\n    inputs = {'a': {'dtype': 'float32', 'shape': []}}", "shape []"),
        ("h:X", "import no_such_dependency_here\nclass X: pass", "no_such_dependency_here"),
        ("not a path", None, "Use module:attribute"),
    ],
)
def test_a_handler_that_cannot_load_stops_the_worker_with_one_line(
    tmp_path: Path, redis_url: str, handler: str, source: str | None, words: str
) -> None:
    if source is not None:
        (tmp_path / "h.py").write_text(source)
    extra = f'[pipeline]\nhandler = "{handler}"\n'
    config = write_config(tmp_path, "multi_io", redis_url, extra=extra)
    with pytest.raises(ConfigError) as caught:
        prepare(load_config(config), "w")
    message = str(caught.value)
    assert "pipeline.handler" in message
    assert words in message
    assert "\n" not in message


BATCH_HANDLER = '''
import numpy as np

CALLS = []


class Batched:
    """Batch hooks only: one call per pool thread's share of a read."""

    inputs = {"x": {"dtype": "float32", "shape": [-1, 3]}}

    def preprocess_batch(self, requests):
        CALLS.append(len(requests))
        out = []
        for r in requests:
            if (r["x"] < 0).any():
                raise ValueError("negative values are refused")
            out.append({"a": r["x"], "b": np.zeros((len(r["x"]), 2), np.int64)})
        return out

    def postprocess_batch(self, outputs, inputs, model_inputs):
        return [{"twice": o["twice"], "a_seen": m["a"]} for o, m in zip(outputs, model_inputs)]
'''


def test_batch_hooks_isolate_a_failing_request_by_splitting(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    (tmp_path / "batched.py").write_text(textwrap.dedent(BATCH_HANDLER))
    extra = '[pipeline]\nhandler = "batched:Batched"\nthreads = 1\n'
    config = write_config(tmp_path, "multi_io", redis_url, extra=extra)
    xs = [np.full((1, 3), float(i), np.float32) for i in range(8)]
    xs[5] = -xs[5] - 1
    with running_worker(config):
        pipe = rconn.pipeline(transaction=False)
        for i, x in enumerate(xs):
            send(pipe, "multi_io", f"x{i}", {"x": x})  # type: ignore[arg-type]
        pipe.execute()
        replies = [wait_reply(rconn, f"x{i}") for i in range(8)]
    for i, reply in enumerate(replies):
        if i == 5:
            assert reply.error is not None
            assert reply.error.code == "INVALID_INPUT"
            assert reply.error.message == "negative values are refused"
            continue
        assert reply.ok, reply.error
        assert reply.outputs is not None
        np.testing.assert_array_equal(reply.outputs["twice"], xs[i] * 2)
        np.testing.assert_array_equal(reply.outputs["a_seen"], xs[i])  # model inputs reach post


# Silero-VAD-like: input [N,4], state [2,N,3] (rows on axis 1), sr int64 [] (no rows)
# -> out [N,1] = sum(input) * sr, stateN [2,N,3] = state + 1.
def _vad_model(path: Path) -> Path:
    onnx = pytest.importorskip("onnx")
    h, tp = onnx.helper, onnx.TensorProto
    graph = h.make_graph(
        [
            h.make_node("ReduceSum", ["input", "axes"], ["s"], keepdims=1),
            h.make_node("Cast", ["sr"], ["srf"], to=tp.FLOAT),
            h.make_node("Mul", ["s", "srf"], ["out"]),
            h.make_node("Add", ["state", "one"], ["stateN"]),
        ],
        "vad",
        [
            h.make_tensor_value_info("input", tp.FLOAT, ["N", 4]),
            h.make_tensor_value_info("state", tp.FLOAT, [2, "N", 3]),
            h.make_tensor_value_info("sr", tp.INT64, []),
        ],
        [
            h.make_tensor_value_info("out", tp.FLOAT, ["N", 1]),
            h.make_tensor_value_info("stateN", tp.FLOAT, [2, "N", 3]),
        ],
        [
            h.make_tensor("axes", tp.INT64, [1], [1]),
            h.make_tensor("one", tp.FLOAT, [], [1.0]),
        ],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


VAD_AXES = """
[inputs.state]
batch_axis = 1
[inputs.sr]
batch_axis = "none"
[outputs.stateN]
batch_axis = 1
"""


def test_batch_axes_serve_a_silero_style_model_batched_and_runs_apart_by_sr(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    _vad_model(tmp_path / "vad.onnx")
    config = tmp_path / "vad.toml"
    config.write_text(
        f'[redis]\nurl = "{redis_url}"\nprefix = "redbatch"\n[model]\nname = "vad"\n'
        'path = "vad.onnx"\nproviders = ["cpu"]\n[batching]\nmax_batch_size = 8\n'
        f"max_wait_ms = 200\n[warmup]\nruns = 1\n{VAD_AXES}"
    )
    rng = np.random.default_rng(0)
    requests = []
    for i in range(6):
        rows = 1 + i % 2
        requests.append(
            {
                "input": rng.normal(size=(rows, 4)).astype(np.float32),
                "state": rng.normal(size=(2, rows, 3)).astype(np.float32),
                "sr": np.array(16000 if i % 3 else 8000, np.int64),
            }
        )
    with running_worker(config):
        pipe = rconn.pipeline(transaction=False)
        for i, inputs in enumerate(requests):
            send(pipe, "vad", f"v{i}", inputs)  # type: ignore[arg-type]
        pipe.execute()
        replies = [wait_reply(rconn, f"v{i}") for i in range(len(requests))]
        send(rconn, "vad", "bad-sr", {**requests[0], "sr": np.array([1, 2], np.int64)})
        bad = wait_reply(rconn, "bad-sr")
    for inputs, reply in zip(requests, replies, strict=True):
        assert reply.ok, reply.error
        assert reply.outputs is not None
        expected = inputs["input"].sum(axis=1, keepdims=True) * float(inputs["sr"])
        np.testing.assert_allclose(reply.outputs["out"], expected, rtol=1e-5)
        np.testing.assert_allclose(reply.outputs["stateN"], inputs["state"] + 1)
    # batched: some run held more rows than one request had; apart by sr: none mixed rates
    assert max(r.batch_rows or 0 for r in replies) > 2
    assert bad.error is not None
    assert "input 'sr': expected shape []" in bad.error.message


def test_a_native_string_model_is_served(
    tmp_path: Path, redis_url: str, rconn: redis.Redis
) -> None:
    onnx = pytest.importorskip("onnx")
    h, tp = onnx.helper, onnx.TensorProto
    graph = h.make_graph(
        [h.make_node("Identity", ["words"], ["same"])],
        "strings",
        [h.make_tensor_value_info("words", tp.STRING, ["N", 2])],
        [h.make_tensor_value_info("same", tp.STRING, ["N", 2])],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, tmp_path / "strings.onnx")
    config = tmp_path / "strings.toml"
    config.write_text(
        f'[redis]\nurl = "{redis_url}"\nprefix = "redbatch"\n[model]\nname = "strings"\n'
        'path = "strings.onnx"\nproviders = ["cpu"]\n[warmup]\nruns = 1\n'
    )
    with running_worker(config):
        send(rconn, "strings", "s1", {"words": [["héllo", "wörld"], ["a", ""]]})
        send(rconn, "strings", "s2", {"words": [[b"raw", b"bytes"]]})
        ok, wrong = wait_reply(rconn, "s1"), wait_reply(rconn, "s2")
    assert ok.outputs is not None
    assert ok.outputs["same"].tolist() == [["héllo", "wörld"], ["a", ""]]
    assert wrong.error is not None
    assert "expected dtype string, got bytes" in wrong.error.message


def test_each_stage_s_time_is_measured(config: Path, rconn: redis.Redis) -> None:
    from prometheus_client import generate_latest

    from worker.ops.metrics import Metrics

    metrics = Metrics()
    with running_worker(config, metrics=metrics):
        for i in range(10):
            send(rconn, "multi_io", f"m{i}", _text("1,2,3"))
        for i in range(10):
            assert wait_reply(rconn, f"m{i}").ok
    totals = metrics.stages.snapshot()
    assert totals["threads"] == 2
    # warmup runs its hooks through another Metrics-less pipeline: these are the 10 requests
    assert totals["preprocess"]["requests"] == 10
    assert totals["postprocess"]["requests"] == 10
    assert totals["preprocess"]["busy_s"] > 0
    assert totals["model"]["busy_s"] > 0
    text = generate_latest(metrics.registry).decode()
    assert "redbatch_preprocess_seconds_count 10.0" in text
    assert 'redbatch_pipeline_busy_seconds_total{stage="preprocess"}' in text
    assert "redbatch_pipeline_threads 2.0" in text
    assert "process_cpu_seconds_total" in text


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("def warmup_inputs(self): raise OSError('sample missing')", "OSError: sample missing"),
        ("def warmup_inputs(self): return {'text': [b'x']}", "expected dtype string, got bytes"),
        ("def preprocess(self, i): raise RuntimeError('broken')", "RuntimeError: broken"),
    ],
)
def test_a_pipeline_that_fails_its_warmup_stops_the_worker_naming_the_hook(
    tmp_path: Path, redis_url: str, body: str, words: str
) -> None:
    from worker.errors import ModelError

    source = textwrap.dedent(HANDLER) + "\n\nclass Broken(Numbers):\n    " + body + "\n"
    (tmp_path / "numbers_handler.py").write_text(source)
    extra = PIPELINE.replace("numbers_handler:Numbers", "numbers_handler:Broken")
    config = write_config(tmp_path, "multi_io", redis_url, extra=extra)
    with pytest.raises(ModelError) as caught:
        prepare(load_config(config), "w")
    assert words in str(caught.value)
