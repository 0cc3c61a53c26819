"""The bundled several-models config (configs/several.toml) end to end: one worker serving the
demo classifier and the two examples' pipelines under a budget of two sessions, driven by the
CLI and the client as if each model had a worker of its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from harness import direct_run, running_fleet
from test_examples import IMAGE_CONFIG, TEXT_CONFIG, _direct, models  # noqa: F401 (a fixture)
from test_run_pipeline import SENTENCES, assert_rows_match, pages, read_rows

from examples.common.reference import DirectRun
from producer import Client
from producer.cli.main import main
from tools.localredis import LocalRedis
from worker.fleet.fleet import Fleet

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "several.toml"


@pytest.fixture(scope="module")
def fleet(redis_server: LocalRedis, models: Path) -> Iterator[Fleet]:  # noqa: F811
    from tools.synthetic import save

    if not (ROOT / "models" / "demo.onnx").exists():
        save("demo", ROOT / "models" / "demo.onnx")
    environ = {"REDIS_URL": redis_server.url}  # overrides the config's redis.url
    with running_fleet(CONFIG, "several", environ=environ) as serving:
        yield serving


def _run(url: str, *args: str) -> int:
    return main(["--redis-url", url, "run", "--no-progress", *args])


def test_one_worker_serves_the_demo_and_both_pipelines_through_the_cli_and_the_client(
    fleet: Fleet, redis_server: LocalRedis, tmp_path: Path
) -> None:
    url = redis_server.url
    # At start: demo and orientation held (config order), minilm released
    assert fleet.budget.held == ["demo", "orientation"]
    # Sentences to the text pipeline: minilm loads on demand, orientation is released
    (tmp_path / "s.txt").write_text("\n".join(SENTENCES) + "\n")
    assert _run(url, "--model", "minilm", "--input", str(tmp_path / "s.txt"),
                "--output", str(tmp_path / "v.jsonl")) == 0  # fmt: skip
    text: DirectRun = _direct(TEXT_CONFIG)
    expected = {n: text({"text": np.array([s], dtype=object)}) for n, s in enumerate(SENTENCES, 1)}
    assert_rows_match(read_rows(tmp_path / "v.jsonl"), expected)
    assert "minilm" in fleet.budget.held
    # Pages to the image pipeline, in the low class (a batch job's): loaded again
    files = pages(tmp_path / "pages", ["a.jpg", "b.png"])
    assert _run(url, "--model", "orientation", "--input", str(tmp_path / "pages"),
                "--priority", "low", "--output", str(tmp_path / "labels.jsonl")) == 0  # fmt: skip
    image: DirectRun = _direct(IMAGE_CONFIG)
    answers = {k: image({"image": np.array([v], dtype=object)}) for k, v in files.items()}
    assert_rows_match(read_rows(tmp_path / "labels.jsonl"), answers)
    # A tensor to the demo model, as an interactive caller
    x = np.linspace(-1, 1, 48, dtype=np.float32).reshape(3, 16)
    with Client("demo", url) as client:
        out = client.infer({"features": x}, priority="high", timeout_s=60)
    np.testing.assert_allclose(
        out["probs"], direct_run(ROOT / "models" / "demo.onnx", {"features": x})["probs"], rtol=1e-5
    )
    assert len(fleet.budget.held) <= 2
    assert sum(s.held.state().loads for s in fleet.slots.values()) >= 5  # 3 at start, 2 on demand
