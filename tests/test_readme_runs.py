"""Every ``redbatch run`` line of the README's "From the command line:" block, run as written.

The lines are parsed out of README.md, so the front page cannot drift from the code: for each,
small input files of the kind it names are made in a temporary folder (generated JPEG and PNG
pages, sentences, feature rows), the line runs in-process against live workers of the shipped
examples (``orientation``, ``minilm``) and of the quick start's ``demo`` model, and every row it
writes must equal a direct run of the same pipeline or model.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import direct_run, running_worker, write_config
from test_examples import IMAGE_CONFIG, TEXT_CONFIG, _direct, models  # noqa: F401 (a fixture)
from test_run_pipeline import SENTENCES, assert_rows_match, example_workers, pages, read_rows

from examples.common.reference import DirectRun
from producer.cli.main import main
from tools.localredis import LocalRedis

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

README = Path(__file__).resolve().parents[1] / "README.md"
MODELS = {"demo", "orientation", "minilm"}


def readme_runs() -> list[list[str]]:
    """The ``redbatch run`` lines of the README's command-line block, split as a shell would."""
    text = README.read_text(encoding="utf-8")
    found = re.search(r"From the command line:\s*```bash\n(.*?)```", text, re.S)
    assert found, "README.md has no 'From the command line:' bash block"
    lines = [shlex.split(line, comments=True) for line in found.group(1).splitlines()]
    return [argv for argv in lines if argv[:2] == ["redbatch", "run"]]


RUNS = readme_runs()


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(
    redis_server: LocalRedis,
    models: Path,  # noqa: F811 (test_examples' fixture)
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path]]:
    """The module's Redis with a worker of each model the README runs; and the demo model."""
    pytest.importorskip("worker.pipeline.hooks", reason="the worker has no pipeline support")
    url = redis_server.url
    config = write_config(tmp_path_factory.mktemp("demo"), "demo", url)
    with contextlib.ExitStack() as stack:
        stack.enter_context(example_workers(url, IMAGE_CONFIG, TEXT_CONFIG))
        stack.enter_context(running_worker(config, name="demo-1"))
        yield url, config.parent / "demo.onnx"


@pytest.fixture(scope="module")
def direct(models: Path) -> dict[str, DirectRun]:  # noqa: F811
    return {"orientation": _direct(IMAGE_CONFIG), "minilm": _direct(TEXT_CONFIG)}


# -- the inputs each line names -------------------------------------------------------------------


def _demo_input(path: Path) -> dict[Any, dict[str, np.ndarray]]:
    """Feature rows for the demo model, by row."""
    x = np.random.default_rng(3).uniform(-2, 2, (5, 16)).astype(np.float32)
    if path.suffix == ".npy":
        np.save(path, x)
    else:
        np.savez(path, features=x)
    return {i: {"features": x[i : i + 1]} for i in range(len(x))}


def _image_input(text: str) -> dict[Any, dict[str, np.ndarray]]:
    """Pages matching a folder or glob (and one that a glob leaves out), by path."""
    if "*" in text:
        names = [
            text.replace("**/", "").replace("*", "p0"),
            text.replace("**/", "s/").replace("*", "p1"),
        ]
        other = "other.png" if not text.endswith(".png") else "other.jpg"
        pages(Path(text.split("*", maxsplit=1)[0] or "."), [other])
    else:
        names = [f"{text.rstrip('/')}/p0.jpg", f"{text.rstrip('/')}/s/p1.png"]
    files = pages(Path("."), names)
    return {str(Path(k)): {"image": np.array([v], dtype=object)} for k, v in files.items()}


def _text_input(path: Path, argv: list[str]) -> dict[Any, dict[str, np.ndarray]]:
    """Sentences in the file the line names, by the key it carries."""
    key, columns = _option(argv, "--key"), _option(argv, "--columns")
    if path.suffix == ".txt":
        path.write_text("\n".join(SENTENCES) + "\n")
        keys: list[Any] = list(range(1, len(SENTENCES) + 1))
    else:
        keys = [f"k{i}" for i in range(len(SENTENCES))] if key else None
        rows = [
            {"text": s} | ({"lang": "en"} if columns else {}) | ({key: k} if key else {})
            for s, k in zip(SENTENCES, keys or SENTENCES, strict=True)
        ]
        if path.suffix == ".jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            keys = keys or list(range(1, len(rows) + 1))
        else:
            table = pa.Table.from_pylist(rows)
            if path.suffix == ".parquet":
                pq.write_table(table, path)
            else:
                with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
                    w.write_table(table)
            keys = keys or list(range(len(rows)))
    return {k: {"text": np.array([s], dtype=object)} for k, s in zip(keys, SENTENCES, strict=True)}


# -- the lines ----------------------------------------------------------------------------------


def test_the_readme_runs_every_shipped_model() -> None:
    assert {_option(argv, "--model") for argv in RUNS} == MODELS


@pytest.mark.parametrize("argv", RUNS, ids=[" ".join(a[2:6]) for a in RUNS])
def test_a_readme_run_line_works_as_written(
    served: tuple[str, Path],
    direct: dict[str, DirectRun],
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, demo_model = served
    monkeypatch.chdir(tmp_path)
    model, source = _option(argv, "--model"), _option(argv, "--input")
    assert model in MODELS, f"README runs model {model!r}, which no shipped example serves"
    assert source is not None
    if model == "demo":
        inputs = _demo_input(Path(source))
    elif model == "orientation":
        inputs = _image_input(source)
    else:
        inputs = _text_input(Path(source), argv)

    # When the line runs as the README writes it
    assert main(["--redis-url", url, *argv[1:], "--no-progress"]) == 0

    # Then every row equals a direct run of its input
    if model == "demo":
        expected = {k: direct_run(demo_model, v) for k, v in inputs.items()}
    else:
        expected = {k: direct[model](v) for k, v in inputs.items()}
    rows = read_rows(Path(_option(argv, "--output") or ""))
    if rows and rows[0][0] is None:  # an .npz of arrays' outputs: rows in input order
        rows = [(i, r) for i, (_, r) in enumerate(rows)]
    assert_rows_match(rows, expected)
