"""``redbatch run`` against live pipeline workers: the image and text examples, real models.

Every input kind a pipeline takes (a folder or glob of JPEG and PNG files, a .txt, JSON lines,
Parquet and Arrow columns of text and binary) goes through the command line into a real worker
of the example's own config, and every row written (.npz, .parquet, .jsonl) must equal a direct
run of the same handler and model (``examples.common.reference``). Also: a model with no live
worker is refused at once unless ``--wait-for-worker``, an unreachable Redis fails in seconds,
and ``Client.map`` takes iterators of bytes and strings for the same workers.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from harness import running_worker, write_config
from test_examples import IMAGE_CONFIG, TEXT_CONFIG, _direct, models  # noqa: F401 (a fixture)

from examples.common.reference import DirectRun, same_outputs
from examples.image.handler import sample_page
from producer import Client
from producer.cli.main import main
from producer.jobs.blocks import text_array
from producer.jobs.checks import check_against_workers, model_dtypes, single_input_name
from producer.protocol import keys
from producer.protocol.errors import UsageError
from producer.protocol.lanes import lane_stream, lanes_key
from tools.localredis import LocalRedis, free_port

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "word " * 40,
]


# -- what the tests share (test_readme_runs imports these) ---------------------------------------


@contextlib.contextmanager
def example_workers(url: str, *configs: Path) -> Iterator[None]:
    """A worker of each example config, serving the Redis at ``url`` (REDIS_URL overrides
    the configs' own redis.url)."""
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        patch.setenv("REDIS_URL", url)
        for i, config in enumerate(configs):
            stack.enter_context(running_worker(config, name=f"w{i}"))
        yield


def pages(folder: Path, names: list[str]) -> dict[str, bytes]:
    """Small generated pages, turned by each of 0, 90, 180, 270 degrees in turn, written under
    ``folder`` as each name's suffix says (.jpg or .png); returns path -> bytes."""
    written = {}
    for i, name in enumerate(names):
        fmt = "PNG" if name.endswith(".png") else "JPEG"
        data = sample_page(320, 400, fmt, angle=(90 * i) % 360)
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written[str(path)] = data
    return written


def run_cli(url: str, *args: str) -> int:
    """``redbatch run`` in-process; returns its exit status."""
    return main(["--redis-url", url, "run", "--no-progress", *args])


def read_rows(path: Path) -> list[tuple[Any, dict[str, np.ndarray]]]:
    """An output file's rows as (key, {output: that row as an array of one row}); the key is
    None for an .npz without one."""
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        key_names = [n for n in ("path", "line", "id", "row") if n in arrays]
        keys_ = arrays.pop(key_names[0]).tolist() if key_names else None
        rows = len(next(iter(arrays.values())))
        return [
            (None if keys_ is None else keys_[i], {n: a[i : i + 1] for n, a in arrays.items()})
            for i in range(rows)
        ]
    if path.suffix == ".parquet":
        records = pq.read_table(path).to_pylist()
    else:
        records = [json.loads(line) for line in path.read_text().splitlines()]
    out = []
    for record in records:
        key_name = next(n for n in ("path", "line", "id", "row") if n in record)
        key = record.pop(key_name)
        out.append((key, {n: np.asarray([v]) for n, v in record.items()}))
    return out


def assert_rows_match(
    rows: list[tuple[Any, dict[str, np.ndarray]]],
    expected: Mapping[Any, Mapping[str, np.ndarray]],
) -> None:
    """Each written row equals the direct run of its input (looked up by key)."""
    assert len(rows) == len(expected)
    for key, got in rows:
        problems = same_outputs(got, expected[key])
        assert problems == [], (key, problems)


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(redis_server: LocalRedis, models: Path) -> Iterator[str]:  # noqa: F811
    """The module's Redis, with one image and one text example worker serving it."""
    pytest.importorskip("worker.pipeline.hooks", reason="the worker has no pipeline support")
    with example_workers(redis_server.url, IMAGE_CONFIG, TEXT_CONFIG):
        yield redis_server.url


@pytest.fixture(scope="module")
def image_run(models: Path) -> DirectRun:  # noqa: F811
    return _direct(IMAGE_CONFIG)


@pytest.fixture(scope="module")
def text_run(models: Path) -> DirectRun:  # noqa: F811
    return _direct(TEXT_CONFIG)


def _image_answers(run: DirectRun, files: Mapping[str, bytes]) -> dict[Any, dict[str, Any]]:
    return {k: run({"image": np.array([v], dtype=object)}) for k, v in files.items()}


def _text_answer(run: DirectRun, text: str) -> dict[str, np.ndarray]:
    return run({"text": np.array([text], dtype=object)})


# -- images -------------------------------------------------------------------------------------


@pytest.mark.parametrize("out", ["labels.npz", "labels.parquet", "labels.jsonl"])
def test_a_folder_of_jpeg_and_png_pages(
    url: str, image_run: DirectRun, tmp_path: Path, out: str
) -> None:
    # Given a folder of JPEG and PNG pages (one in a subfolder), turned every which way
    files = pages(tmp_path / "pages", ["a.jpg", "b.png", "c.jpg", "sub/d.png"])

    # When the folder runs through the image example's worker, no flag naming its input
    assert run_cli(url, "--model", "orientation", "--input", str(tmp_path / "pages"),
                   "--output", str(tmp_path / out)) == 0  # fmt: skip

    # Then every row is the direct run's label, score and scores, keyed by its path
    rows = read_rows(tmp_path / out)
    assert_rows_match(rows, _image_answers(image_run, files))
    labels = {Path(k).name: r["label"][0] for k, r in rows}
    assert labels == {"a.jpg": "0", "b.png": "270", "c.jpg": "180", "d.png": "90"}


def test_a_glob_of_jpegs_to_parquet_keeps_string_and_vector_columns(
    url: str, image_run: DirectRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    files = pages(Path("images"), ["x/1.jpg", "x/y/2.jpg", "3.png"])
    jpegs = {k: v for k, v in files.items() if k.endswith(".jpg")}

    assert run_cli(url, "--model", "orientation", "--input", "images/**/*.jpg",
                   "--output", "labels.parquet") == 0  # fmt: skip

    table = pq.read_table("labels.parquet")
    assert table.schema.field("label").type == pa.string()
    assert table.schema.field("scores").type == pa.list_(pa.float32(), 4)
    assert_rows_match(read_rows(Path("labels.parquet")), _image_answers(image_run, jpegs))


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_binary_column_of_images(
    url: str, image_run: DirectRun, tmp_path: Path, kind: str
) -> None:
    files = pages(tmp_path, ["p.jpg", "q.png", "r.jpg"])
    blobs = list(files.values())
    table = pa.table({"id": [10, 11, 12], "image": pa.array(blobs, pa.binary())})
    source = tmp_path / f"images.{kind}"
    if kind == "parquet":
        pq.write_table(table, source)
    else:
        with pa.OSFile(str(source), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    assert run_cli(url, "--model", "orientation", "--input", str(source), "--key", "id",
                   "--output", str(tmp_path / "labels.jsonl")) == 0  # fmt: skip

    expected = {
        10 + i: image_run({"image": np.array([b], dtype=object)}) for i, b in enumerate(blobs)
    }
    assert_rows_match(read_rows(tmp_path / "labels.jsonl"), expected)


# -- text ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("out", ["vectors.npz", "vectors.parquet", "vectors.jsonl"])
def test_a_txt_of_sentences(url: str, text_run: DirectRun, tmp_path: Path, out: str) -> None:
    # Given a .txt of sentences with an empty line among them (skipped, its number kept)
    (tmp_path / "s.txt").write_text("\n".join([*SENTENCES[:2], "", *SENTENCES[2:]]) + "\n")

    assert run_cli(url, "--model", "minilm", "--input", str(tmp_path / "s.txt"),
                   "--output", str(tmp_path / out)) == 0  # fmt: skip

    lines = [1, 2, 4, 5]
    expected = {n: _text_answer(text_run, s) for n, s in zip(lines, SENTENCES, strict=True)}
    rows = read_rows(tmp_path / out)
    assert_rows_match(rows, expected)
    assert all(r["embedding"].shape == (1, 384) for _, r in rows)


def test_json_lines_with_a_key(url: str, text_run: DirectRun, tmp_path: Path) -> None:
    docs = [{"id": f"doc-{i}", "text": s, "lang": "en"} for i, s in enumerate(SENTENCES)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))

    assert run_cli(url, "--model", "minilm", "--input", str(tmp_path / "docs.jsonl"),
                   "--columns", "text", "--key", "id",
                   "--output", str(tmp_path / "v.parquet")) == 0  # fmt: skip

    expected = {d["id"]: _text_answer(text_run, d["text"]) for d in docs}
    assert_rows_match(read_rows(tmp_path / "v.parquet"), expected)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_a_string_column(url: str, text_run: DirectRun, tmp_path: Path, kind: str) -> None:
    table = pa.table({"id": [7, 8, 9, 10], "text": SENTENCES, "score": [1.0, 2.0, 3.0, 4.0]})
    source = tmp_path / f"table.{kind}"
    if kind == "parquet":
        pq.write_table(table, source)
    else:
        with pa.OSFile(str(source), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    assert run_cli(url, "--model", "minilm", "--input", str(source), "--columns", "text",
                   "--key", "id", "--output", str(tmp_path / "v.npz")) == 0  # fmt: skip

    expected = {7 + i: _text_answer(text_run, s) for i, s in enumerate(SENTENCES)}
    assert_rows_match(read_rows(tmp_path / "v.npz"), expected)


def test_input_name_and_dtype_string_send_files_and_binary_as_text(
    url: str, text_run: DirectRun, tmp_path: Path
) -> None:
    # Given a folder of text files, one of them not UTF-8, and a binary column of sentences
    notes = tmp_path / "notes"
    notes.mkdir()
    for i, sentence in enumerate(SENTENCES[:3]):
        (notes / f"{i}.txt").write_text(sentence)
    (notes / "bad.txt").write_bytes(b"caf\xe9")
    blobs = pa.table({"text": pa.array([s.encode() for s in SENTENCES], pa.binary())})
    pq.write_table(blobs, tmp_path / "blobs.parquet")

    # When each is sent with the input named and its dtype given
    code = run_cli(url, "--model", "minilm", "--input", str(notes), "--input-name", "text",
                   "--dtype", "text=string", "--output", str(tmp_path / "notes.jsonl"))  # fmt: skip
    blob_out = tmp_path / "b.parquet"
    blob_code = run_cli(url, "--model", "minilm", "--input", str(tmp_path / "blobs.parquet"),
                        "--dtype", "text=string", "--output", str(blob_out))  # fmt: skip

    # Then the text files are string rows; the one that is not UTF-8 is listed, not sent
    assert code == 1
    expected = {
        str(notes / f"{i}.txt"): _text_answer(text_run, s) for i, s in enumerate(SENTENCES[:3])
    }
    rows = read_rows(tmp_path / "notes.jsonl")
    assert_rows_match(rows[:3], expected)
    [error] = [
        json.loads(x) for x in (tmp_path / "notes.jsonl.errors.jsonl").read_text().splitlines()
    ]
    assert (error["code"], error["key"]) == ("UNREADABLE", str(notes / "bad.txt"))
    assert "is not UTF-8" in error["message"]
    assert blob_code == 0
    expected_rows = {i: _text_answer(text_run, s) for i, s in enumerate(SENTENCES)}
    assert_rows_match(read_rows(blob_out), expected_rows)


def test_dtypes_that_do_not_fit_are_refused_before_sending(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "s.txt").write_text("one\n")
    np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))
    out = ["--output", str(tmp_path / "y.npz")]

    assert run_cli(url, "--model", "minilm", "--input", str(tmp_path / "s.txt"), *out,
                   "--dtype", "text=float32") == 2  # fmt: skip
    assert "--dtype text=float32" in capsys.readouterr().err
    assert run_cli(url, "--model", "minilm", "--input", str(tmp_path / "s.txt"), *out,
                   "--dtype", "other=string") == 2  # fmt: skip
    assert "--dtype other: not an input" in capsys.readouterr().err
    assert run_cli(url, "--model", "minilm", "--input", str(tmp_path / "x.npy"), *out,
                   "--input-name", "text") == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "input 'text' is float32, but the pipeline of model 'minilm' takes string" in err
    assert "a .txt (a row per line)" in err
    assert "tokeniz" not in err


# -- outputs a pipeline does not declare ----------------------------------------------------------


def test_outputs_are_checked_against_the_pipeline_not_the_model(
    url: str, image_run: DirectRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = pages(tmp_path / "p", ["a.jpg"])
    base = ["--model", "orientation", "--input", str(tmp_path / "p")]

    assert (
        run_cli(url, *base, "--outputs", "fetch_name_0", "--output", str(tmp_path / "y.npz")) == 2
    )
    err = capsys.readouterr().err
    assert "the pipeline of model 'orientation' answers no such output" in err
    assert "the pipeline answers label, score, scores" in err
    assert run_cli(url, *base, "--outputs", "label", "--output", str(tmp_path / "y.npz")) == 0
    [(key, row)] = read_rows(tmp_path / "y.npz")
    assert key == next(iter(files))
    want = image_run({"image": np.array(list(files.values()), dtype=object)})
    assert same_outputs(row, {"label": want["label"]}) == []


def test_a_pipeline_that_declares_no_outputs_takes_any_outputs_name() -> None:
    # Given a record whose pipeline takes 'text' but does not say what it answers
    pipeline = {"handler": "h:H", "inputs": [{"name": "text", "dtype": "string", "shape": [-1]}]}
    record = {
        "inputs": [{"name": "ids", "dtype": "int64", "shape": [-1, 8]}],
        "outputs": [{"name": "hidden", "dtype": "float32", "shape": [-1, 8]}],
        "pipeline": {**pipeline, "outputs": None},
    }
    args = argparse.Namespace(model="m", outputs=["label"], rows_per_request=1, input_name=None)
    rows = {"text": text_array(["a sentence"])}

    # Then the pipeline's input is the one to send, and any output name may be asked for
    assert single_input_name(args, [record]) == "text"
    assert model_dtypes([record]) == {"text": "string"}
    check_against_workers(args, rows, [record], "text", "line")
    # but one it declares is checked
    record["pipeline"]["outputs"] = [{"name": "vector", "dtype": "float32", "shape": [-1, 2]}]
    with pytest.raises(UsageError, match="--outputs label: the pipeline of model 'm' answers no "):
        check_against_workers(args, rows, [record], "text", "line")


# -- no worker, no Redis ------------------------------------------------------------------------


def test_a_model_without_a_live_worker_is_refused_naming_those_with_one(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "s.txt").write_text("one\ntwo\n")
    argv = [
        "--model",
        "minlm",
        "--input",
        str(tmp_path / "s.txt"),
        "--output",
        str(tmp_path / "v.npz"),
    ]

    started = time.monotonic()
    code = run_cli(url, *argv)
    took = time.monotonic() - started

    err = capsys.readouterr().err
    assert code == 2
    assert took < 5
    assert "model 'minlm' has no live worker" in err
    assert "models with live workers: 'minilm', 'orientation'" in err
    assert "--wait-for-worker" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "v.npz").exists()
    with Client("minlm", url) as client:
        assert client.workers() == []
    r = redis.Redis.from_url(url)
    assert not r.exists(keys.request_stream(keys.DEFAULT_PREFIX, "minlm"))
    assert not r.exists(lane_stream(keys.DEFAULT_PREFIX, "minlm", "low"))

    # With --wait-for-worker the requests are sent and wait for a worker (here: in vain)
    code = run_cli(url, *argv, "--wait-for-worker", "--input-name", "text", "--timeout-s", "0.5")
    err = capsys.readouterr().err
    assert code == 1
    assert "note: no live worker for model 'minlm'" in err
    low = lane_stream(keys.DEFAULT_PREFIX, "minlm", "low")  # a run is a batch job: class low
    assert r.xlen(low) >= 1
    errors = (tmp_path / "v.npz.errors.jsonl").read_text()
    assert "WAIT_TIMEOUT" in errors
    r.delete(low, lanes_key(keys.DEFAULT_PREFIX, "minlm"))
    r.close()


def test_an_unreachable_redis_fails_in_seconds_naming_its_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "s.txt").write_text("one\n")
    closed = f"redis://:hunter2@127.0.0.1:{free_port()}/0"

    started = time.monotonic()
    code = run_cli(closed, "--model", "minilm", "--input", str(tmp_path / "s.txt"),
                   "--output", str(tmp_path / "v.npz"))  # fmt: skip
    took = time.monotonic() - started

    err = capsys.readouterr().err
    assert code == 2
    assert took < 6
    assert "Could not talk to Redis at redis://127.0.0.1:" in err
    assert "nothing answered in" in err
    assert "hunter2" not in err
    assert not (tmp_path / "v.npz").exists()


# -- Client.map with rows from files ------------------------------------------------------------


def test_client_map_takes_iterators_of_bytes_and_of_strings(
    url: str, image_run: DirectRun, text_run: DirectRun, tmp_path: Path
) -> None:
    files = pages(tmp_path, ["a.jpg", "b.png", "c.jpg"])
    paths = sorted(files)
    with Client("orientation", url) as client:
        chunks = list(
            client.map({"image": (Path(p).read_bytes() for p in paths)}, rows_per_request=2)
        )
    assert [c.start for c in chunks] == [0, 2]
    for chunk in chunks:
        assert chunk.ok, chunk.error
        for i in range(chunk.start, chunk.stop):
            row = {n: a[i - chunk.start : i - chunk.start + 1] for n, a in chunk.outputs.items()}
            want = image_run({"image": np.array([files[paths[i]]], dtype=object)})
            assert same_outputs(row, want) == []

    (tmp_path / "s.txt").write_text("\n".join(SENTENCES) + "\n")
    with Client("minilm", url) as client, (tmp_path / "s.txt").open() as lines:
        chunks = list(client.map({"text": (line.rstrip("\n") for line in lines)}))
    got = np.concatenate([c.outputs["embedding"] for c in chunks if c.ok])
    assert got.shape == (len(SENTENCES), 384)
    for i, sentence in enumerate(SENTENCES):
        assert same_outputs({"embedding": got[i : i + 1]}, _text_answer(text_run, sentence)) == []


def test_bytes_outputs_in_jsonl_are_base64() -> None:
    from producer.jobs.jsonlsink import _values

    array = np.empty(2, dtype=object)
    array[:] = [b"\x00\xff", b"ok"]
    assert _values("bytes", array) == [base64.b64encode(b"\x00\xff").decode(), "b2s="]
    assert _values("float32", np.array([[1.5, np.nan]], np.float32)) == [[1.5, None]]


# -- a pipeline whose handler refuses rows: the errors file and the summary ----------------------

# The model multi_io (a float32 [N,3], b int64 [N,2] -> twice, total) behind a handler that
# takes "x,y,z" lines; it refuses a row with a ValueError (INVALID_INPUT), whose message names
# the row, or is the same for every row starting with "bad".
CSV_HANDLER = """
import numpy as np


class CsvStats:
    inputs = {"text": {"dtype": "string", "shape": [-1]}}
    outputs = {"sum": {"dtype": "float32", "shape": [-1]},
               "npos": {"dtype": "int64", "shape": [-1]}}

    def preprocess(self, inputs):
        rows = []
        for text in inputs["text"]:
            if text.startswith("bad"):
                raise ValueError("this row is marked bad")
            try:
                rows.append([float(v) for v in text.split(",")])
            except ValueError:
                raise ValueError(f"row {text!r} is not three numbers separated by commas")
        return {"a": np.array(rows, np.float32), "b": np.zeros((len(rows), 2), np.int64)}

    def postprocess(self, outputs, inputs):
        twice = outputs["twice"]
        return {"sum": twice.sum(axis=1).astype(np.float32),
                "npos": (twice > 0).sum(axis=1).astype(np.int64)}

    def warmup_inputs(self):
        return {"text": np.array(["1,2,3"], dtype=object)}
"""


@pytest.fixture(scope="module")
def csv_url(redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The module's Redis with a worker of model 'csvstats': multi_io behind CSV_HANDLER."""
    pytest.importorskip("worker.pipeline.hooks", reason="the worker has no pipeline support")
    folder = tmp_path_factory.mktemp("csvstats")
    (folder / "csv_stats.py").write_text(CSV_HANDLER)
    extra = '[pipeline]\nhandler = "csv_stats:CsvStats"\n'
    config = write_config(folder, "multi_io", redis_server.url, name="csvstats", extra=extra)
    with example_workers(redis_server.url, config):
        yield redis_server.url


def _errors(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_refused_request_has_its_own_errors_line_with_its_rid_and_message(
    csv_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given 24 lines the handler refuses, one row per request: the first 12 with one message
    # (as a bad column would give), the rest each with its own
    lines = [f"bad {i}" for i in range(12)] + [f"x{i},y" for i in range(12, 24)]
    (tmp_path / "rows.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "stats.jsonl"

    assert run_cli(csv_url, "--model", "csvstats", "--input", str(tmp_path / "rows.txt"),
                   "--output", str(out)) == 1  # fmt: skip

    # Then every request answered is one line: its rows, its rid, its key and its message
    errors = _errors(tmp_path / "stats.jsonl.errors.jsonl")
    assert [(e["start"], e["stop"], e["key"], e["last_key"]) for e in errors] == [
        (i, i + 1, i + 1, i + 1) for i in range(24)
    ]
    assert {e["code"] for e in errors} == {"INVALID_INPUT"}
    assert all(keys.is_valid_rid(e["rid"]) for e in errors)
    assert len({e["rid"] for e in errors}) == 24
    assert [e["message"] for e in errors[:12]] == ["this row is marked bad"] * 12
    assert errors[12]["message"] == "row 'x12,y' is not three numbers separated by commas"
    # and the summary names the first failed row as the errors file does, saying how
    summary = capsys.readouterr().out
    assert "failed      INVALID_INPUT 24 rows; listed in" in summary
    assert "row numbers count from 0" in summary
    assert "  first error: row 0 (line 1): INVALID_INPUT: this row is marked bad" in summary


def test_the_errors_file_is_written_empty_when_every_row_succeeds(
    csv_url: str, tmp_path: Path
) -> None:
    # Given an errors file left by an earlier run beside the output
    (tmp_path / "rows.txt").write_text("1,2,3\n4,5,-6\n")
    stale = tmp_path / "stats.npz.errors.jsonl"
    stale.write_text('{"start": 0, "stop": 1, "rid": "old"}\n')

    assert run_cli(csv_url, "--model", "csvstats", "--input", str(tmp_path / "rows.txt"),
                   "--output", str(tmp_path / "stats.npz")) == 0  # fmt: skip

    # Then it is rewritten, empty, so that it never describes another run's outputs
    assert stale.read_text() == ""
    with np.load(tmp_path / "stats.npz") as npz:
        np.testing.assert_allclose(npz["sum"], [12.0, 6.0])
        assert npz["npos"].tolist() == [3, 2]


def test_refusals_before_sending_name_the_pipeline_not_the_model(
    csv_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "rows.txt").write_text("1,2,3\n")
    np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))
    out = ["--output", str(tmp_path / "y.npz")]

    # An output the pipeline does not answer (the model's own 'twice', say)
    assert run_cli(csv_url, "--model", "csvstats", "--input", str(tmp_path / "rows.txt"), *out,
                   "--outputs", "twice") == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "--outputs twice: the pipeline of model 'csvstats' answers no such output" in err
    assert "the pipeline answers npos, sum" in err
    assert "model 'csvstats' has" not in err

    # An input of the wrong dtype
    assert run_cli(csv_url, "--model", "csvstats", "--input", str(tmp_path / "x.npy"), *out,
                   "--input-name", "text") == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "input 'text' is float32, but the pipeline of model 'csvstats' takes string" in err
    assert "'s" not in err.replace("it's", "")
