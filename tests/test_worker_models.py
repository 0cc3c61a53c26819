"""Models of several shapes: multi-input/output, free non-batch dims, fixed batch, and isolation."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from harness import direct_run, running_worker, send, stream_is_empty, wait_reply, write_config

from worker.model.session import OnnxModel

SLOW_WINDOW = "max_batch_size = 32\nmax_wait_ms = 300"


def _send_all(rconn, model: str, requests: list[tuple[str, dict]], **kw) -> None:
    """Send many requests in one pipeline, so they land in the same batch window."""
    pipe = rconn.pipeline(transaction=False)
    for rid, inputs in requests:
        send(pipe, model, rid, inputs, **kw)
    pipe.execute()


def test_bad_request_does_not_fail_its_batch(tmp_path: Path, redis_url: str, rconn) -> None:
    # Given a batch of Gather lookups where one index is out of the table's range
    config = write_config(tmp_path, "gather", redis_url, batching=SLOW_WINDOW)
    requests = [(f"g{i}", {"idx": np.array([[i % 10]], np.int64)}) for i in range(24)]
    requests[11] = ("g11", {"idx": np.array([[99]], np.int64)})
    with running_worker(config):
        _send_all(rconn, "gather", requests)
        replies = {rid: wait_reply(rconn, rid) for rid, _ in requests}

    # Then only that request fails, with the runtime's message, and the rest are right
    failed = replies.pop("g11")
    assert failed.error is not None
    assert failed.error.code == "INFERENCE_FAILED"
    assert "failed on this request" in failed.error.message
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    for rid, reply in replies.items():
        i = int(rid[1:])
        assert reply.ok, reply.error
        np.testing.assert_array_equal(reply.outputs["rows"], table[[i % 10]][:, None, :])
    assert max(r.batch_rows for r in replies.values()) > 1  # healthy neighbours still batched
    assert stream_is_empty(rconn, "gather")


def test_multi_input_multi_output_equals_direct_run(tmp_path: Path, redis_url: str, rconn) -> None:
    config = write_config(tmp_path, "multi_io", redis_url)
    rng = np.random.default_rng(5)
    requests = []
    for i in range(20):
        rows = int(rng.integers(1, 4))
        requests.append(
            (
                f"m{i}",
                {
                    "a": rng.normal(size=(rows, 3)).astype(np.float32),
                    "b": rng.integers(-50, 50, size=(rows, 2)).astype(np.int64),
                },
            )
        )
    with running_worker(config):
        _send_all(rconn, "multi_io", requests)
        replies = [wait_reply(rconn, rid) for rid, _ in requests]
    for (_, inputs), reply in zip(requests, replies, strict=True):
        want = direct_run(tmp_path / "multi_io.onnx", inputs)
        assert reply.ok, reply.error
        assert set(reply.outputs) == {"twice", "total"}
        np.testing.assert_allclose(reply.outputs["twice"], want["twice"])
        np.testing.assert_array_equal(reply.outputs["total"], want["total"])
        assert reply.outputs["total"].dtype == np.int64
        assert reply.model.version == "7"


def test_outputs_selection_returns_only_what_was_asked(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    config = write_config(tmp_path, "multi_io", redis_url)
    inputs = {"a": np.ones((2, 3), np.float32), "b": np.ones((2, 2), np.int64)}
    with running_worker(config):
        send(rconn, "multi_io", "only-total", inputs, outputs=["total"])
        send(rconn, "multi_io", "both", inputs)
        only = wait_reply(rconn, "only-total")
        both = wait_reply(rconn, "both")
    assert set(only.outputs) == {"total"}
    np.testing.assert_array_equal(only.outputs["total"], [2, 2])
    assert set(both.outputs) == {"twice", "total"}


def test_free_dimension_requests_run_as_equal_shape_sub_batches(
    tmp_path: Path, redis_url: str, rconn
) -> None:
    # Given requests whose free dimension S differs, interleaved in one window
    config = write_config(tmp_path, "free_dim", redis_url, batching=SLOW_WINDOW)
    requests = [(f"s{i}", {"x": np.full((1, 2 + i % 3), float(i), np.float32)}) for i in range(18)]
    with running_worker(config):
        _send_all(rconn, "free_dim", requests)
        replies = {rid: wait_reply(rconn, rid) for rid, _ in requests}

    # Then each got its own shape back, and requests of one shape shared a run
    for rid, inputs in requests:
        reply = replies[rid]
        assert reply.ok, reply.error
        np.testing.assert_array_equal(reply.outputs["doubled"], inputs["x"] * 2)
        np.testing.assert_allclose(reply.outputs["total"], inputs["x"].sum(axis=1))
        assert reply.batch_rows is not None
        assert reply.batch_rows <= 6  # never mixed with the other shapes
    assert max(r.batch_rows for r in replies.values()) > 1


def test_fixed_batch_model_is_padded_and_sliced(tmp_path: Path, redis_url: str, rconn) -> None:
    config = write_config(
        tmp_path, "fixed_batch", redis_url, batching="max_batch_size = 4\nmax_wait_ms = 1"
    )
    x = np.array([[-1.0, 2.0, -3.0]], np.float32)
    with running_worker(config):
        send(rconn, "fixed_batch", "one-row", {"x": x})
        reply = wait_reply(rconn, "one-row")
    assert reply.ok, reply.error
    np.testing.assert_array_equal(reply.outputs["y"], np.maximum(x, 0))


def test_rows_not_requests_fill_a_batch(tmp_path: Path, redis_url: str, rconn) -> None:
    # Given four requests of 10 rows each in one window, at max_batch_size 32
    config = write_config(tmp_path, "free_dim", redis_url, batching=SLOW_WINDOW)
    requests = [(f"ten-{i}", {"x": np.full((10, 2), float(i), np.float32)}) for i in range(4)]
    with running_worker(config):
        _send_all(rconn, "free_dim", requests)
        replies = [wait_reply(rconn, rid) for rid, _ in requests]
    # Then three ran together (30 rows) and the fourth, which would make 40, ran next
    assert [r.batch_rows for r in replies] == [30, 30, 30, 10]
    for (_, inputs), reply in zip(requests, replies, strict=True):
        np.testing.assert_array_equal(reply.outputs["doubled"], inputs["x"] * 2)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_multi_row_requests_count_rows_toward_the_batch(
    tmp_path: Path, redis_url: str, rconn, rows: int
) -> None:
    config = write_config(tmp_path, "free_dim", redis_url)
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    with running_worker(config):
        send(rconn, "free_dim", f"rows-{rows}", {"x": x})
        reply = wait_reply(rconn, f"rows-{rows}")
    assert reply.ok
    assert reply.outputs["doubled"].shape == (rows, 2)
    assert reply.batch_rows == rows


def test_deadline_is_checked_again_just_before_each_run(
    tmp_path: Path, redis_url: str, rconn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two requests formed into one batch, in two sub-batches of different shapes, where
    # the first sub-batch's run outlasts the second request's deadline
    deadline_ms = int(time.time() * 1000) + 1500
    real_run = OnnxModel.run

    def slow_for_width_2(self, feeds, output_names):
        if feeds["x"].shape[1] == 2:  # a model slower than the deadline, simulated
            threading.Event().wait(max(deadline_ms / 1000 - time.time(), 0) + 0.2)
        return real_run(self, feeds, output_names)

    monkeypatch.setattr(OnnxModel, "run", slow_for_width_2)
    config = write_config(tmp_path, "free_dim", redis_url, batching=SLOW_WINDOW)
    with running_worker(config):
        pipe = rconn.pipeline(transaction=False)
        send(pipe, "free_dim", "first", {"x": np.ones((1, 2), np.float32)})
        send(
            pipe, "free_dim", "second", {"x": np.ones((1, 3), np.float32)}, deadline_ms=deadline_ms
        )
        pipe.execute()
        first, second = wait_reply(rconn, "first"), wait_reply(rconn, "second")

    # Then the first ran, and the second was not run: its deadline passed while it waited
    assert first.ok
    assert second.error is not None
    assert second.error.code == "DEADLINE_EXCEEDED"
