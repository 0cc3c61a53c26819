"""Config errors stop the worker before it touches Redis, naming the dotted key and the fix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
from harness import write_config

from worker.cli import main
from worker.config import load_config, parse_config
from worker.errors import ConfigError, ModelError
from worker.service import prepare
from worker.synthetic import save

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    save("demo", tmp_path / "m.onnx")
    return tmp_path


def _parse(model_dir: Path, **tables: dict) -> object:
    data = {"model": {"name": "demo", "path": "m.onnx"}, **tables}
    if "model_extra" in tables:
        data["model"].update(data.pop("model_extra"))
    return parse_config(data, base_dir=model_dir)


@pytest.mark.parametrize(
    ("tables", "words"),
    [
        ({"batching": {"max_wiat_ms": 5}}, ["'batching.max_wiat_ms'", "max_wait_ms"]),
        ({"surprise": {}}, ["'surprise'", "batching"]),
        ({"batching": {"max_batch_size": 0}}, ["'batching.max_batch_size'", ">= 1"]),
        ({"batching": {"max_batch_size": "32"}}, ["'batching.max_batch_size'", "integer"]),
        ({"batching": {"max_wait_ms": -1}}, ["'batching.max_wait_ms'", ">= 0"]),
        ({"limits": {"reject_non_finite": "yes"}}, ["'limits.reject_non_finite'", "true or false"]),
        ({"delivery": {"max_deliveries": 0}}, ["'delivery.max_deliveries'"]),
        ({"delivery": {"reply_ttl_s": 10**17}}, ["'delivery.reply_ttl_s'", "315360000"]),
        ({"metrics": {"port": 70000}}, ["'metrics.port'", "65535"]),
        ({"metrics": {"host": " "}}, ["'metrics.host'", "127.0.0.1"]),
        ({"metrics": {"host": "::"}}, ["'metrics.host'", "IPv4"]),
        ({"redis": {"url": "http://x"}}, ["'redis.url'", "redis://"]),
        ({"redis": {"prefix": "a{b}"}}, ["'redis.prefix'", "braces"]),
        ({"model_extra": {"providers": ["gpu"]}}, ["'model.providers'", "cuda"]),
        ({"model_extra": {"providers": []}}, ["'model.providers'", "at least one"]),
        ({"model_extra": {"cuda": {"device_id": 0}}}, ["[model.cuda]", "providers"]),
        (
            {"model_extra": {"providers": ["cuda"], "cuda": {"arena_extend_strategy": "big"}}},
            ["'model.cuda.arena_extend_strategy'", "kSameAsRequested"],
        ),
        ({"model_extra": {"name": "bad name"}}, ["'model.name'"]),
        ({"model_extra": {"path": "missing.onnx"}}, ["'model.path'", "does not exist"]),
        ({"inputs": {"features": {"min": 3.0, "max": 1.0}}}, ["'inputs.features.min'", "Swap"]),
        ({"inputs": {"features": {"mni": 3.0}}}, ["'inputs.features.mni'", "min"]),
    ],
)
def test_bad_config_names_the_key_and_the_fix(model_dir: Path, tables: dict, words: list) -> None:
    with pytest.raises(ConfigError) as info:
        _parse(model_dir, **tables)
    for word in words:
        assert word in str(info.value)


def test_metrics_listen_on_every_interface_unless_told(model_dir: Path) -> None:
    assert _parse(model_dir).metrics.host == "0.0.0.0"
    assert _parse(model_dir, metrics={"host": "127.0.0.1"}).metrics.host == "127.0.0.1"


def test_redis_url_from_environment_overrides_the_file(model_dir: Path) -> None:
    path = model_dir / "c.toml"
    path.write_text('[redis]\nurl = "redis://a:1/0"\n[model]\nname = "demo"\npath = "m.onnx"\n')
    assert load_config(path, environ={}).redis.url == "redis://a:1/0"
    assert load_config(path, environ={"REDIS_URL": "rediss://u:p@b:2/1"}).redis.url == (
        "rediss://u:p@b:2/1"
    )


def test_shipped_configs_load_so_they_cannot_drift(tmp_path: Path) -> None:
    save("demo", ROOT / "models" / "demo.onnx")
    demo = load_config(ROOT / "configs" / "demo.toml", environ={})
    assert demo.model.name == "demo"
    reference = load_config(ROOT / "configs" / "reference.toml", environ={})
    assert reference.batching.max_batch_size == 32
    assert [p.name for p in reference.model.providers] == ["cuda", "cpu"]


def test_model_with_fixed_batch_below_max_batch_size_is_a_config_error(
    tmp_path: Path, redis_url: str
) -> None:
    config = write_config(tmp_path, "fixed_batch", redis_url)  # fixed batch 4, max 32
    with pytest.raises(ConfigError, match=r"batching\.max_batch_size.*fixed batch dimension of 4"):
        prepare(load_config(config, environ={}), "w")


def test_output_without_batch_axis_is_refused(tmp_path: Path, redis_url: str) -> None:
    config = write_config(tmp_path, "no_batch_output", redis_url)
    with pytest.raises(ModelError, match=r"output 'y' has shape \[3\], with no batch dimension"):
        prepare(load_config(config, environ={}), "w")


def test_inputs_table_for_an_unknown_input_is_refused(tmp_path: Path, redis_url: str) -> None:
    config = write_config(tmp_path, "demo", redis_url, extra="[inputs.feature]\nmin = 0.0")
    with pytest.raises(ConfigError, match=r"\[inputs.feature\].*features"):
        prepare(load_config(config, environ={}), "w")


def test_missing_cuda_falls_back_with_one_log_line(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = write_config(tmp_path, "demo", redis_url)
    text = config.read_text().replace('providers = ["cpu"]', 'providers = ["cuda", "cpu"]')
    config.write_text(text)
    with caplog.at_level(logging.WARNING):
        prepared = prepare(load_config(config, environ={}), "w")
    assert prepared.record["runtime"]["providers"] == ["CPUExecutionProvider"]
    assert prepared.record["runtime"]["requested_providers"] == ["cuda", "cpu"]
    lines = [r.getMessage() for r in caplog.records if "cuda" in r.getMessage()]
    assert len(lines) == 1


def test_required_provider_that_cannot_start_stops_the_worker(
    tmp_path: Path, redis_url: str
) -> None:
    config = write_config(tmp_path, "demo", redis_url)
    text = config.read_text().replace(
        'providers = ["cpu"]', 'providers = ["cuda", "cpu"]\n[model.cuda]\nrequire = true'
    )
    config.write_text(text)
    with pytest.raises(ModelError, match=r"'cuda' is required \(model.cuda.require = true\)"):
        prepare(load_config(config, environ={}), "w")


def test_cli_rejects_bad_config_with_exit_2_before_touching_redis(
    tmp_path: Path, redis_url: str, rconn, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, "demo", redis_url, extra="[batching2]\nx = 1")
    before = rconn.info("stats")["total_connections_received"]
    assert main(["--config", str(config)]) == 2
    after = rconn.info("stats")["total_connections_received"]
    assert after == before
    errors = [line for line in capsys.readouterr().err.splitlines() if " ERROR " in line]
    assert len(errors) == 1
    assert "'batching2'" in errors[0]


def test_cli_check_prints_the_record_without_redis(tmp_path: Path, capsys) -> None:
    config = write_config(tmp_path, "demo", "redis://127.0.0.1:1/0")  # nothing listens there
    assert main(["--config", str(config), "--check"]) == 0
    assert '"sha256"' in capsys.readouterr().out


def test_unreachable_redis_is_not_a_config_error() -> None:
    # Guard for the test above: port 1 really refuses connections.
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=1, socket_connect_timeout=0.5).ping()


class _FakeOrt:
    """Stands in for onnxruntime's module where only ``preload_dlls`` matters."""

    def __init__(self, prints: str = "", raises: Exception | None = None) -> None:
        self.calls = 0
        self.prints = prints
        self.raises = raises

    def preload_dlls(self) -> None:
        self.calls += 1
        if self.prints:
            print(self.prints)
        if self.raises is not None:
            raise self.raises


def test_cuda_libraries_from_nvidia_packages_are_preloaded_when_installed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys
) -> None:
    import importlib.util

    from worker import model

    real_find_spec = importlib.util.find_spec
    installed = {"nvidia": False}

    def find_spec(name: str, *args: object):
        if name == "nvidia":
            return object() if installed["nvidia"] else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(model.importlib.util, "find_spec", find_spec)
    ort = _FakeOrt(prints="Failed to load libcudnn.so.9: not found")
    assert not model.preload_cuda_libraries(ort)  # no nvidia packages: CUDA from the system
    assert ort.calls == 0

    installed["nvidia"] = True
    with caplog.at_level(logging.WARNING):
        assert model.preload_cuda_libraries(ort)
    assert ort.calls == 1
    assert capsys.readouterr().out == ""  # what onnxruntime printed went to the log
    assert any("libcudnn.so.9" in r.getMessage() for r in caplog.records)

    broken = _FakeOrt(raises=OSError("bad ELF"))
    assert model.preload_cuda_libraries(broken)  # logged, never raised


def test_cuda_libraries_are_preloaded_only_when_cuda_is_asked_for(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker import model

    calls: list[object] = []
    monkeypatch.setattr(model, "preload_cuda_libraries", calls.append)
    config = write_config(tmp_path, "demo", redis_url)
    prepare(load_config(config, environ={}), "w")
    assert calls == []  # a CPU worker never touches CUDA libraries
    config.write_text(config.read_text().replace('["cpu"]', '["cuda", "cpu"]'))
    prepare(load_config(config, environ={}), "w")
    assert len(calls) == 1
