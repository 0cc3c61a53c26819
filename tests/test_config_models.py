"""The ``[[models]]`` config (contract section 8): each entry becomes the WorkerConfig the same
model would have alone, worker-wide tables shared, and errors name the entry."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from tools.synthetic import save
from worker.cli import main
from worker.config.served import load_served, parse_served
from worker.config.settings import parse_config
from worker.errors import ConfigError

TWO = """
[redis]
url = "redis://127.0.0.1:1/0"
[scheduling]
min_share_low = 0.2
[worker]
max_loaded_models = 1

[[models]]
name = "demo"
path = "demo.onnx"
version = "3"
[models.batching]
max_batch_size = 8
[models.inputs.features]
min = -10.0

[[models]]
name = "tiny"
path = "tiny.onnx"
[models.delivery]
max_deliveries = 7
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    save("demo", tmp_path / "demo.onnx")
    save("tiny", tmp_path / "tiny.onnx")
    return tmp_path


def test_each_entry_is_the_config_its_model_would_have_alone(folder: Path) -> None:
    served = parse_served(tomllib.loads(TWO), folder)
    demo, tiny = served.models
    assert served.worker.max_loaded_models == 1
    assert (demo.model.name, demo.model.version, tiny.model.name) == ("demo", "3", "tiny")
    assert (demo.batching.max_batch_size, tiny.batching.max_batch_size) == (8, 32)
    assert (demo.delivery.max_deliveries, tiny.delivery.max_deliveries) == (3, 7)
    assert demo.inputs["features"].min == -10.0
    assert tiny.inputs == {}
    # worker-wide tables are shared
    assert demo.redis == tiny.redis
    assert demo.scheduling.min_share_low == tiny.scheduling.min_share_low == 0.2
    # and an entry gives what the same model alone in a [model] config gives
    alone = parse_config(
        {
            "redis": {"url": "redis://127.0.0.1:1/0"},
            "scheduling": {"min_share_low": 0.2},
            "model": {"name": "demo", "path": "demo.onnx", "version": "3"},
            "batching": {"max_batch_size": 8},
            "inputs": {"features": {"min": -10.0}},
        },
        folder,
    )
    assert demo == alone


def test_a_single_model_table_is_the_one_model_case(folder: Path) -> None:
    data = {"model": {"name": "demo", "path": "demo.onnx"}, "worker": {"max_loaded_models": 1}}
    served = parse_served(data, folder)
    assert [m.model.name for m in served.models] == ["demo"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d["models"][1].update(pth="x"), ["'models[1].pth'", "path"]),
        (lambda d: d["models"][0].update(path="nope.onnx"), ["'models[0].path'", "does not exist"]),
        (
            lambda d: d["models"][0]["batching"].update(max_batch_size=0),
            ["'models[0].batching.max_batch_size'", ">= 1"],
        ),
        (lambda d: d["models"][1].update(name="demo"), ["'models[1].name'", "'models[0].name'"]),
        (lambda d: d.update(model={"name": "x", "path": "demo.onnx"}), ["both a [model]"]),
        (lambda d: d.update(batching={"max_batch_size": 4}), ["[batching]", "[models.batching]"]),
        (lambda d: d.update(models=[]), ["array of tables"]),
        (lambda d: d["worker"].update(max_loaded_models=-1), ["'worker.max_loaded_models'"]),
    ],
)
def test_errors_name_the_entry_and_the_fix(folder: Path, change, words: list[str]) -> None:
    data = tomllib.loads(TWO)
    change(data)
    with pytest.raises(ConfigError) as raised:
        parse_served(data, folder)
    for word in words:
        assert word in str(raised.value)


def test_the_worker_checks_several_models_and_one_entry(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two = folder / "two.toml"
    two.write_text(TWO)
    assert main(["--config", str(two), "--check"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["model"]["name"] for r in records] == [m.model.name for m in load_served(two).models]
    one = folder / "one.toml"
    one.write_text(TWO.split('[[models]]\nname = "tiny"', maxsplit=1)[0])
    assert len(load_served(one).models) == 1
    assert main(["--config", str(one), "--check"]) == 0
    assert "model" in json.loads(capsys.readouterr().out)  # one model: its record alone
