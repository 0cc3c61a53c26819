"""``model.sha256`` pins the served file: a different file is a config error naming both hashes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from harness import write_config

from tools.synthetic import save
from worker import warmup
from worker.cli import main
from worker.config import load_config, parse_config
from worker.errors import ConfigError
from worker.model.session import check_sha256, read_model_file


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    return save("demo", tmp_path / "m.onnx")


def _config_sha256(model_path: Path, value: object) -> str | None:
    data = {"model": {"name": "demo", "path": model_path.name, "sha256": value}}
    return parse_config(data, base_dir=model_path.parent).model.sha256


def test_sha256_is_optional(model_path: Path) -> None:
    data = {"model": {"name": "demo", "path": model_path.name}}
    assert parse_config(data, base_dir=model_path.parent).model.sha256 is None


def test_sha256_is_read_and_lowercased(model_path: Path) -> None:
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
    assert _config_sha256(model_path, digest.upper()) == digest


@pytest.mark.parametrize("value", ["abc", "g" * 64, "0" * 63, "0" * 65, 123, ""])
def test_malformed_sha256_names_the_key_and_the_form(model_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"'model\.sha256'.*(64 hex digits|Use a string)"):
        _config_sha256(model_path, value)


def test_matching_file_is_accepted(model_path: Path) -> None:
    model_file = read_model_file(model_path)
    pinned = _config_sha256(model_path, model_file.sha256.upper())
    check_sha256(model_file, pinned)  # no error
    check_sha256(model_file, None)  # nothing pinned: nothing to check


def test_different_file_is_refused_naming_key_expected_and_actual(model_path: Path) -> None:
    # Given a config pinned to the file as deployed
    pinned = _config_sha256(model_path, read_model_file(model_path).sha256)
    # When another model is copied over it
    save("tiny", model_path)
    swapped = read_model_file(model_path)
    # Then the worker refuses it, naming what it expected and what it found
    assert pinned is not None
    assert swapped.sha256 != pinned
    with pytest.raises(ConfigError) as info:
        check_sha256(swapped, pinned)
    message = str(info.value)
    assert "'model.sha256'" in message
    assert pinned in message
    assert swapped.sha256 in message
    assert str(model_path) in message


def test_worker_refuses_a_pinned_hash_mismatch_before_touching_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 1 refuses connections: reaching Redis at all would be a different error.
    config = write_config(
        tmp_path, "demo", "redis://127.0.0.1:1/0", model_extra=f'sha256 = "{"0" * 64}"'
    )
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "'model.sha256'" in err
    assert "0" * 64 in err


def test_a_file_swapped_while_the_worker_loads_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a config pinned to the deployed file
    config_path = write_config(tmp_path, "demo", "redis://127.0.0.1:1/0")
    model_path = tmp_path / "demo.onnx"
    pinned = read_model_file(model_path).sha256
    config_path.write_text(
        config_path.read_text().replace('version = "7"', f'version = "7"\nsha256 = "{pinned}"')
    )
    real_model = warmup.OnnxModel

    def swapping(model_config, max_batch_size):  # When another model lands during the load
        save("tiny", model_path)
        return real_model(model_config, max_batch_size)

    monkeypatch.setattr(warmup, "OnnxModel", swapping)
    # Then the worker refuses to serve it
    with pytest.raises(ConfigError, match=r"'model\.sha256'"):
        warmup.prepare(load_config(config_path), "w1")
