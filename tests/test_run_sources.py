"""``redbatch run`` over inputs other than arrays (files, text, JSON lines, Parquet and Arrow),
streamed, with .parquet and .npz outputs that carry each row's key; against a real Redis and an
echo worker thread (the worker proper has no string model to serve)."""

from __future__ import annotations

import glob
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest
import redis

from producer.cli.main import main
from producer.client.maprows import RowFeed
from producer.client.results import Chunk, Result
from producer.jobs import sinks
from producer.jobs.blocks import Block, Skipped, Source, SourceOptions
from producer.jobs.filewalk import iter_files
from producer.jobs.job import format_summary, run_job
from producer.jobs.sources import open_source
from producer.protocol import codec, keys
from producer.protocol.lanes import lane_stream

MODEL = "echo"
PREFIX = keys.DEFAULT_PREFIX
BAD = ("bad", b"bad")


def echo_reply(fields: dict[bytes, bytes]) -> tuple[str, bytes]:
    """Each string or bytes input ``s`` comes back as ``s`` and ``s_len`` (int64 lengths),
    each numeric one doubled; a request holding a value starting with "bad", or a negative
    number, is INVALID_INPUT."""
    rid = fields[b"rid"].decode()
    body = codec.decode_request(fields[b"body"], 1 << 26)
    outputs: dict[str, np.ndarray] = {}
    error = None
    for name, value in body.inputs.items():
        if codec.wire_dtype(value) in ("string", "bytes"):
            if any(e[:3] in BAD for e in value.ravel()):
                error = codec.ErrorInfo("INVALID_INPUT", f"input {name!r} holds a bad value.")
            lengths = [len(e) for e in value.ravel()]
            outputs[f"{name}_len"] = np.asarray(lengths, np.int64).reshape(value.shape)
            outputs[name] = value
        else:
            if (value < 0).any():
                error = codec.ErrorInfo("INVALID_INPUT", f"input {name!r} is negative.")
            outputs[name] = value * 2
    common: dict[str, Any] = {
        "rid": rid,
        "model": codec.ModelRef(MODEL, "1", "0" * 64),
        "worker": "echo-1",
        "timings_ms": {"queued": 0.1, "inference": 0.1},
    }
    if error is not None:
        return rid, codec.encode_reply(codec.Reply(ok=False, error=error, **common))
    rows = len(next(iter(body.inputs.values())))
    reply = codec.Reply(ok=True, outputs=outputs, batch_rows=rows, **common)
    return rid, codec.encode_reply(reply)


class EchoWorker(threading.Thread):
    """Answers ``echo_reply`` over the contract's stream and the low lane (where ``redbatch
    run`` sends by default) until stopped (an entry with a ``stop`` field wakes its blocking
    read)."""

    def __init__(self, url: str, model: str = MODEL) -> None:
        super().__init__(daemon=True)
        self.conn = redis.Redis.from_url(url, socket_timeout=None)  # its read blocks until work
        self.model = model
        self.stream = keys.request_stream(PREFIX, model)
        self.streams = [self.stream, lane_stream(PREFIX, model, "low")]
        self.error: BaseException | None = None
        for stream in self.streams:
            try:
                self.conn.xgroup_create(stream, keys.CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        # a live record, as a real worker keeps one: redbatch run refuses a model without
        self.conn.set(keys.worker_key(PREFIX, model, "echo-1"), json.dumps({"name": "echo-1"}))
        self.conn.sadd(keys.workers_key(PREFIX, model), "echo-1")

    def run(self) -> None:
        try:
            while True:
                got = self.conn.xreadgroup(
                    keys.CONSUMER_GROUP, "echo-1", dict.fromkeys(self.streams, ">"), count=512,
                    block=0,
                )  # fmt: skip
                entries = [(stream, e) for stream, batch in got or [] for e in batch]
                stop = any(b"stop" in fields for _, (_, fields) in entries)
                pipe = self.conn.pipeline(transaction=False)
                for stream, (entry_id, fields) in entries:
                    if b"stop" not in fields:
                        rid, reply = echo_reply(fields)
                        key = keys.reply_key(PREFIX, self.model, rid)
                        pipe.rpush(key, reply)
                        pipe.expire(key, 60)
                    pipe.xack(stream, keys.CONSUMER_GROUP, entry_id)
                    pipe.xdel(stream, entry_id)
                pipe.execute()
                if stop:
                    return
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> None:
        if self.is_alive():
            self.conn.xadd(self.stream, {"stop": "1"})
            self.join(timeout=10)
        self.conn.close()
        if self.error is not None:
            raise self.error


@pytest.fixture
def echo(redis_url: str) -> Iterator[EchoWorker]:
    worker = EchoWorker(redis_url)
    worker.start()
    yield worker
    worker.stop()


def run(redis_url: str, *args: str) -> int:
    return main(["--redis-url", redis_url, "run", "--model", MODEL, "--no-progress", *args])


def errors_of(output: Path) -> list[dict[str, Any]]:
    text = Path(f"{output}.errors.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def register(rconn: redis.Redis, inputs: list[dict[str, Any]]) -> None:
    """A live worker record naming the model's inputs (as a worker's heartbeat would)."""
    record = {"name": "echo-1", "inputs": inputs, "batching": {"max_batch_size": 64}}
    rconn.set(keys.worker_key(PREFIX, MODEL, "echo-1"), json.dumps(record), ex=60)
    rconn.sadd(keys.workers_key(PREFIX, MODEL), "echo-1")


# ---------------------------------------------------------------------------------------------
# Text


@pytest.mark.usefixtures("echo")
def test_text_lines_are_string_rows_keyed_by_line_number(redis_url: str, tmp_path: Path) -> None:
    # Given a .txt with an empty line, a CRLF line, a line the worker refuses, a line that is
    # not UTF-8, and no newline at the end
    text = tmp_path / "in.txt"
    text.write_bytes(b"\xef\xbb\xbfhello\n\nworld\r\nbad one\n\xff\xfe\n  spaced  \ntail")
    out = tmp_path / "out.parquet"

    code = run(redis_url, "--input", str(text), "--input-name", "s", "--output", str(out))

    # Then each line but the empty one is a row, keyed by its line number, its newline (and
    # only its newline) removed; the refused row is null and listed with its line
    assert code == 1
    table = pq.read_table(out).to_pylist()
    assert [(r["line"], r["s"]) for r in table] == [
        (1, "hello"),
        (3, "world"),
        (4, None),
        (6, "  spaced  "),
        (7, "tail"),
    ]
    assert [r["s_len"] for r in table] == [5, 5, None, 10, 4]
    errors = errors_of(out)
    assert [(e["code"], e["key"]) for e in errors] == [("INVALID_INPUT", 4), ("UNREADABLE", 5)]
    assert "line 5 is not UTF-8" in errors[1]["message"]


@pytest.mark.usefixtures("echo")
def test_keep_empty_lines_sends_them_as_empty_strings(redis_url: str, tmp_path: Path) -> None:
    text = tmp_path / "in.txt"
    text.write_text("a\n\nb\n")
    out = tmp_path / "out.npz"

    args = ["--input", str(text), "--input-name", "s", "--output", str(out), "--keep-empty-lines"]
    assert run(redis_url, *args) == 0

    with np.load(out) as got:
        assert got["s"].tolist() == ["a", "", "b"]
        assert got["line"].tolist() == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# Files


@pytest.mark.usefixtures("echo")
def test_a_directory_is_one_bytes_row_per_file_sorted_by_path(
    redis_url: str, tmp_path: Path
) -> None:
    # Given files in nested folders (bytes with trailing NULs), a hidden file and folder, and
    # an earlier run's output inside the directory
    folder = tmp_path / "imgs"
    (folder / "b").mkdir(parents=True)
    (folder / ".cache").mkdir()
    contents = {"a.bin": b"\x00A\x00", "b/c.bin": b"C" * 5, "b/bad.bin": b"bad!", "d.bin": b""}
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    (folder / ".hidden").write_bytes(b"x")
    (folder / ".cache" / "e.bin").write_bytes(b"x")
    out = folder / "out.parquet"
    out.write_bytes(b"an earlier run's output")

    code = run(redis_url, "--input", str(folder), "--input-name", "img", "--output", str(out))

    # Then every visible file is one row, in path order, its bytes exact, keyed by its path
    assert code == 1
    rows = pq.read_table(out).to_pylist()
    paths = sorted(str(folder / name) for name in contents)
    assert [r["path"] for r in rows] == paths
    expected = {str(folder / n): d for n, d in contents.items() if n != "b/bad.bin"}
    assert {r["path"]: r["img"] for r in rows if r["img"] is not None} == expected
    [error] = errors_of(out)
    assert (error["code"], error["key"]) == ("INVALID_INPUT", str(folder / "b/bad.bin"))


@pytest.mark.usefixtures("echo")
def test_a_glob_picks_files_and_the_npz_carries_their_paths(redis_url: str, tmp_path: Path) -> None:
    for i in range(7):
        (tmp_path / f"{i}.txt").write_bytes(bytes([65 + i]) * (i + 1))
    (tmp_path / "skip.dat").write_bytes(b"not matched")
    out = tmp_path / "out.npz"

    args = ["--input", str(tmp_path / "*.txt"), "--input-name", "f", "--output", str(out)]
    assert run(redis_url, *args, "--rows-per-request", "3") == 0

    with np.load(out) as got:
        assert got["path"].tolist() == [str(tmp_path / f"{i}.txt") for i in range(7)]
        assert got["f_len"].tolist() == list(range(1, 8))
        assert got["f"].tolist() == [bytes([65 + i]) * (i + 1) for i in range(7)]


def test_a_glob_that_matches_nothing_is_a_usage_error(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--input", str(tmp_path / "*.jpg"), "--input-name", "f"]
    assert run(redis_url, *args, "--output", str(tmp_path / "y.npz")) == 2
    assert "no files match" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# JSON lines


@pytest.mark.usefixtures("echo")
def test_jsonl_keys_are_inputs_and_the_key_column_is_carried(
    redis_url: str, tmp_path: Path
) -> None:
    # Given objects with an id, a string, an integer list and a float list; a blank line, a
    # line that is not JSON, one missing an input and one whose list is of another shape
    lines = [
        {"id": "a", "text": "one", "n": [1, 2], "x": 0.5},
        None,
        {"id": "b", "text": "two", "n": [3, 4], "x": 1},
        "not json",
        {"id": "c", "text": "three", "x": 2.5},
        {"id": "d", "text": "four", "n": [5], "x": 1.0},
        {"id": "e", "text": "bad", "n": [6, 7], "x": 3.0},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text(
        "\n".join("" if o is None else o if isinstance(o, str) else json.dumps(o) for o in lines)
    )
    out = tmp_path / "out.parquet"

    assert run(redis_url, "--input", str(path), "--key", "id", "--output", str(out)) == 1

    # Then integers are int64, other numbers float32, the key column leads, and every record
    # that is not a row is listed with its line and (when it has one) its key
    table = pq.read_table(out)
    assert table.column_names[0] == "id"
    assert table.schema.field("n").type == pa.list_(pa.int64(), 2)
    assert table.schema.field("x").type == pa.float32()
    rows = table.to_pylist()
    assert [(r["id"], r["n"], r["x"]) for r in rows] == [
        ("a", [2, 4], 1.0),
        ("b", [6, 8], 2.0),
        ("e", None, None),
    ]
    errors = errors_of(out)
    assert [(e["code"], e["key"]) for e in errors] == [
        ("UNREADABLE", None),
        ("UNREADABLE", "c"),
        ("UNREADABLE", "d"),
        ("INVALID_INPUT", "e"),
    ]
    assert "line 4 is not JSON" in errors[0]["message"]
    assert "line 5 has no 'n'" in errors[1]["message"]
    assert "not int64 of shape [2]" in errors[2]["message"]


@pytest.mark.usefixtures("echo")
def test_jsonl_dtypes_come_from_the_option_then_the_live_workers(
    redis_url: str, rconn: redis.Redis, tmp_path: Path
) -> None:
    # Given integers in both inputs, a worker record saying 'a' is float16, and --dtype b
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"a": [i, i], "b": i}) + "\n" for i in range(5)))
    register(
        rconn,
        [
            {"name": "a", "dtype": "float16", "shape": [-1, 2]},
            {"name": "b", "dtype": "float64", "shape": [-1]},
        ],
    )
    out = tmp_path / "out.npz"

    assert run(redis_url, "--input", str(path), "--dtype", "b=uint8", "--output", str(out)) == 2
    assert run(redis_url, "--input", str(path), "--dtype", "b=float64", "--output", str(out)) == 0

    with np.load(out) as got:
        assert got["a"].dtype == np.float16
        assert got["b"].dtype == np.float64
        np.testing.assert_array_equal(got["b"], np.arange(5) * 2)
        assert got["line"].tolist() == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------------------------------------
# Parquet and Arrow


def sample_table(rows: int) -> pa.Table:
    ids = np.arange(100, 100 + rows)
    fixed = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows * 3, dtype=np.float32)), 3)
    ragged = [[float(i), float(i)] if i != 2 else [1.0] for i in range(rows)]
    return pa.table(
        {
            "id": ids,
            "text": [f"t{i}" if i != 4 else None for i in range(rows)],
            "blob": [bytes([i % 256]) * 2 + b"\x00" for i in range(rows)],
            "v": fixed,
            "w": pa.array(ragged, pa.list_(pa.float64())),
            "k": pa.array(np.arange(rows), pa.int32()),
            "when": pa.array(np.arange(rows), pa.timestamp("s")),
        }
    )


@pytest.mark.usefixtures("echo")
def test_parquet_columns_are_inputs_read_in_row_groups(redis_url: str, tmp_path: Path) -> None:
    # Given a Parquet file of several row groups, with a null string and a ragged list
    path = tmp_path / "in.parquet"
    pq.write_table(sample_table(300), path, row_group_size=64)
    out = tmp_path / "out.parquet"
    columns = "text,blob,v,w,k"

    code = run(
        redis_url, "--input", str(path), "--columns", columns, "--key", "id",
        "--output", str(out), "--rows-per-request", "8", "--dtype", "w=float32",
    )  # fmt: skip

    # Then the rows with a null or a list of another shape are skipped, the others sent, each
    # column as the wire carries it, and the key column joins the outputs to the input
    assert code == 1
    got = pq.read_table(out)
    assert got.column("id").to_pylist() == [i for i in range(100, 400) if i not in (102, 104)]
    assert got.schema.field("v").type == pa.list_(pa.float32(), 3)
    assert got.schema.field("w").type == pa.list_(pa.float32(), 2)
    first = got.slice(0, 1).to_pylist()[0]
    assert first == {
        "id": 100, "text_len": 2, "text": "t0", "blob_len": 3, "blob": b"\x00\x00\x00",
        "v": [0.0, 2.0, 4.0], "w": [0.0, 0.0], "k": 0,
    }  # fmt: skip
    errors = errors_of(out)
    assert [(e["code"], e["key"], e["start"]) for e in errors] == [
        ("UNREADABLE", 102, 2),
        ("UNREADABLE", 104, 3),
    ]
    assert "column 'w'" in errors[0]["message"]


def test_parquet_column_of_a_type_the_wire_cannot_carry_is_named(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(sample_table(5), path)
    assert run(redis_url, "--input", str(path), "--output", str(tmp_path / "y.npz")) == 2
    err = capsys.readouterr().err
    assert "column 'when' is timestamp" in err
    assert "--columns" in err


@pytest.mark.usefixtures("echo")
@pytest.mark.parametrize("layout", ["file", "stream"])
def test_arrow_ipc_files_and_streams_are_read_by_batch(
    redis_url: str, tmp_path: Path, layout: str
) -> None:
    table = pa.table(
        {"x": pa.array(np.arange(50, dtype=np.float64)), "s": [f"{i}" for i in range(50)]}
    )
    path = tmp_path / "in.arrow"
    with pa.OSFile(str(path), "wb") as sink:
        new = pa.ipc.new_file if layout == "file" else pa.ipc.new_stream
        with new(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=7):
                writer.write_batch(batch)
    out = tmp_path / "out.npz"

    assert run(redis_url, "--input", str(path), "--output", str(out)) == 0

    with np.load(out) as got:
        np.testing.assert_array_equal(got["x"], np.arange(50) * 2.0)
        assert got["s"].tolist() == [f"{i}" for i in range(50)]
        assert got["row"].tolist() == list(range(50))  # rows skipped would leave gaps


def test_parquet_without_pyarrow_names_the_extra_to_install(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"x": [1.0]}), path)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError

    assert run(redis_url, "--input", str(path), "--output", str(tmp_path / "y.npz")) == 2
    assert "pip install 'redbatch[parquet]'" in capsys.readouterr().err

    np.save(tmp_path / "x.npy", np.ones((2, 1), np.float32))
    args = ["--input", str(tmp_path / "x.npy"), "--input-name", "x"]
    assert run(redis_url, *args, "--output", str(tmp_path / "y.parquet")) == 2
    assert "pip install 'redbatch[parquet]'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Streaming


def test_a_run_reads_its_input_only_as_far_as_it_sends(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given 200,000 lines and no worker: the first window of 4 requests times out
    text = tmp_path / "big.txt"
    text.write_text("".join(f"line {i}\n" for i in range(200_000)))
    out = tmp_path / "out.parquet"

    args = ["--input", str(text), "--input-name", "s", "--output", str(out), "--timeout-s", "0.3"]
    assert run(redis_url, *args, "--concurrency", "4", "--wait-for-worker") == 1

    # Then only a block of lines was read; the rest is listed as not sent, to the input's end
    summary = capsys.readouterr().out
    read = int(summary.split(" read (the rest of the input was not)")[0].split()[-1])
    assert 4 <= read < 10_000
    errors = errors_of(out)
    assert errors[-1]["start"] == 4
    assert errors[-1]["stop"] is None
    assert errors[-1]["key"] == 5  # the first line not sent
    assert pq.read_table(out).num_rows == 4


@pytest.mark.usefixtures("echo")
def test_parquet_output_is_written_a_row_group_at_a_time(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sinks, "_ROW_GROUP_ROWS", 100)
    np.save(tmp_path / "x.npy", np.arange(1000, dtype=np.float32).reshape(500, 2))
    out = tmp_path / "y.parquet"

    args = ["--input", str(tmp_path / "x.npy"), "--input-name", "x", "--output", str(out)]
    assert run(redis_url, *args, "--rows-per-request", "10") == 0

    written = pq.ParquetFile(out)
    assert written.metadata.num_row_groups == 5
    table = written.read()
    assert table.column("row").to_pylist() == list(range(500))
    np.testing.assert_array_equal(
        np.stack(table.column("x").to_numpy(zero_copy_only=False)),
        np.arange(1000, dtype=np.float32).reshape(500, 2) * 2,
    )
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_npz_sink_spools_rows_that_failed_before_any_succeeded(tmp_path: Path) -> None:
    # Rows that fail before the output's shape is known are filled in once it is
    out = tmp_path / "y.npz"
    sink = sinks.NpzSink(out, "path")
    keys_ = np.array(["a", "bb", "ccc"], dtype=object)
    sink.put(0, 1, keys_[:1], None)
    text = np.array(["x", "yy"], dtype=codec.STRING)
    sink.put(1, 3, keys_[1:], {"t": text, "n": np.array([[1.5], [2.5]], np.float32)})
    sink.put(3, 4, np.array(["d"], dtype=object), {"t": text[:1], "n": np.ones((2, 1))})
    sink.commit()

    with np.load(out) as got:
        assert got["path"].tolist() == ["a", "bb", "ccc", "d"]
        assert got["t"].tolist() == ["", "x", "yy", ""]  # the last did not stack: failed
        np.testing.assert_array_equal(got["n"][1:3], [[1.5], [2.5]])
        assert np.isnan(got["n"][[0, 3]]).all()
    assert [p.name for p in tmp_path.iterdir()] == ["y.npz"]


# ---------------------------------------------------------------------------------------------
# The job, with a stand-in for Client.map


class LocalMapper:
    """map() without Redis: each request answered at once, its numbers doubled."""

    def map(self, arrays: Any, *, rows_per_request: int | None, **_: object) -> Iterator[Chunk]:
        feed, start = RowFeed(arrays), 0
        while (rows := feed.take(rows_per_request or 1)) is not None:
            n = len(next(iter(rows.values())))
            outputs = {name: values * 2 for name, values in rows.items()}
            result = Result(
                rid=f"r{start}", ok=True, outputs=outputs, error=None, meta=None,
                model=codec.ModelRef(MODEL, "1", "0" * 64), worker="w", batch_rows=n,
                timings_ms={},
            )  # fmt: skip
            yield Chunk(start, start + n, f"r{start}", outputs, None, result, 1.0)
            start += n


def test_a_reader_failing_part_way_ends_the_input_and_keeps_what_came_back() -> None:
    # Given a reader whose second block fails (a disk error, a corrupt row group)
    def blocks() -> Iterator[Block]:
        yield Block({"x": np.arange(3.0)}, np.array([10, 11, 12]), skipped=[Skipped(1, 99, "no")])
        raise OSError("the disk went away")

    source = Source("jsonl", ["x"], "id", blocks())
    sink = sinks.MemorySink()

    summary = run_job(LocalMapper(), source, rows_per_request=2, sink=sink)

    # Then the rows read came back, the skipped record and the rest of the input are listed
    np.testing.assert_array_equal(sink.arrays["x"], [0.0, 2.0, 4.0])
    assert [(f.start, f.stop, f.code, f.keys) for f in summary.failures] == [
        (1, 1, "UNREADABLE", (99, 99)),
        (3, None, "UNREADABLE", None),
    ]
    assert "the disk went away" in (summary.stopped_by or "")
    assert summary.rows_unread
    assert "4 read (the rest of the input was not)" in format_summary(summary)


def test_progress_of_a_text_input_is_counted_in_bytes_to_its_end(tmp_path: Path) -> None:
    text = tmp_path / "in.txt"
    text.write_text("a\n\nbb\nccc\n\n")  # trailing empty lines: read, never rows
    source = open_source(str(text), SourceOptions(input_name=lambda: "s"))
    seen: list[int] = []

    summary = run_job(LocalMapper(), source, on_progress=seen.append)

    assert summary.rows_ok == 3
    assert sum(seen) == source.total == text.stat().st_size


@pytest.mark.parametrize("pattern", ["*.jpg", "**/*.jpg", "a/**", "a/*/*.jpg", "**", "a/c/[de].*"])
def test_files_are_walked_in_the_order_of_their_sorted_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str
) -> None:
    # Names where a folder's and a file's order differ by the '/' after the folder's name
    for name in ["a.jpg", "a-b.jpg", "a/b.jpg", "a/c/d.jpg", "a/c.jpg", "a/c/e.JPG", "Z.jpg",
                 "b/.hidden.jpg", ".h/x.jpg", "b/x.txt", "a b/é.jpg"]:  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    monkeypatch.chdir(tmp_path)

    found = list(iter_files(pattern))

    assert found == sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    assert found  # the pattern matches something
