"""Issue 27's worker friction: which Redis the worker serves and why, a malformed URL quoted as
written, and the CPU fallback logged as information where there is no GPU, refused where the
config lists no "cpu"."""

from __future__ import annotations

import logging
from pathlib import Path

import onnxruntime as ort
import pytest
from harness import write_config

from worker.cli import main
from worker.config import load_config
from worker.errors import ConfigError, ModelError
from worker.model import gpu
from worker.service import prepare

UNREACHABLE = "redis://127.0.0.1:1/0"  # nothing listens; no test here gets as far as Redis
FALLBACK = "worker.model.fallback"


def _stop_after_start_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """End main() where the model would load: the start line is written by then."""

    def stop(*_: object, **__: object) -> None:
        raise ConfigError("stopped by the test")

    monkeypatch.setattr("worker.fleet.loading.prepare", stop)


def _config(tmp_path: Path, providers: str, url: str = UNREACHABLE, extra: str = "") -> Path:
    path = write_config(tmp_path, "demo", url, model_extra=extra)
    path.write_text(path.read_text().replace('providers = ["cpu"]', f"providers = {providers}"))
    return path


# -- which Redis, and where its URL came from ------------------------------------------------


def test_url_source_is_recorded_for_each_way_it_can_be_given(tmp_path: Path) -> None:
    with_url = write_config(tmp_path, "demo", "redis://a:1/0")
    without = tmp_path / "bare.toml"
    without.write_text(with_url.read_text().replace('url = "redis://a:1/0"\n', ""))
    env = {"REDIS_URL": "redis://b:2/0"}
    seen = [
        (c.redis.url, c.redis.url_from, c.redis.url_overrode)
        for c in (
            load_config(with_url, environ={}),
            load_config(with_url, environ=env),
            load_config(without, environ=env),
            load_config(without, environ={}),
        )
    ]
    assert seen == [
        ("redis://a:1/0", "redis.url", False),
        ("redis://b:2/0", "REDIS_URL", True),
        ("redis://b:2/0", "REDIS_URL", False),
        ("redis://127.0.0.1:6379/0", "default", False),
    ]


def test_worker_logs_its_redis_url_once_redacted_with_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stop_after_start_line(monkeypatch)
    config = write_config(tmp_path, "demo", UNREACHABLE)
    monkeypatch.setenv("REDIS_URL", "redis://user:s3cret@127.0.0.1:1/2")
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "Redis at" in line]
    assert len(lines) == 1
    assert (
        "Redis at redis://user@127.0.0.1:1/2, from REDIS_URL in the environment, which "
        in (lines[0])
    )
    assert "overrides the config's redis.url" in lines[0]
    assert "s3cret" not in err

    monkeypatch.delenv("REDIS_URL")
    assert main(["--config", str(config)]) == 2
    [line] = [x for x in capsys.readouterr().err.splitlines() if "Redis at" in x]
    assert f"Redis at {UNREACHABLE}, from redis.url in the config" in line
    assert "overrides" not in line


def test_check_never_names_a_redis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(write_config(tmp_path, "demo", UNREACHABLE)), "--check"]) == 0
    assert "Redis at" not in capsys.readouterr().err


# -- a malformed URL, quoted as written --------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "guess"),
    [
        ("redis//127.0.0.1:6379", "redis://127.0.0.1:6379"),
        ("redis:/127.0.0.1:6379/1", "redis://127.0.0.1:6379/1"),
        ("localhost:6379", "redis://localhost:6379"),
        ("unix:/run/redis.sock", "unix:///run/redis.sock"),
        ("http://127.0.0.1:6379", None),
    ],
)
def test_malformed_url_is_quoted_as_written_with_the_valid_forms(
    tmp_path: Path, url: str, guess: str | None
) -> None:
    config = write_config(tmp_path, "demo", url)
    with pytest.raises(ConfigError) as info:
        load_config(config, environ={})
    message = str(info.value)
    assert message.startswith(f"Config 'redis.url' has value {url!r}: it does not start with ")
    assert "redis://[[user]:password@]host[:port][/db], rediss://" in message
    assert "unix:///path/to/redis.sock" in message
    assert ("did you mean" in message) == (guess is not None)
    if guess is not None:
        assert f"did you mean {guess!r}?" in message


def test_malformed_redis_url_from_the_environment_exits_2_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bare.toml"
    config.write_text(
        write_config(tmp_path, "demo", UNREACHABLE)
        .read_text()
        .replace(f'url = "{UNREACHABLE}"', "")
    )
    monkeypatch.setenv("REDIS_URL", "redis//u:s3cret@127.0.0.1:6379")
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if " ERROR " in x]
    assert (
        "Environment variable REDIS_URL (read in place of config 'redis.url') has value "
        "'redis//u:***@127.0.0.1:6379': it does not start with redis://" in line
    )
    assert "did you mean 'redis://u:***@127.0.0.1:6379'?" in line
    assert "s3cret" not in err


# -- providers: information without a GPU, a warning with one, a refusal without "cpu" -------


@pytest.mark.skipif(gpu.present(), reason="a GPU is here: CUDA may start, or fail for real")
def test_cpu_machine_logs_the_cuda_fallback_as_information(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The shipped configs' providers on this CPU machine, with the real GPU test."""
    config = _config(tmp_path, '["cuda", "cpu"]')
    with caplog.at_level(logging.INFO):
        prepared = prepare(load_config(config, environ={}), "w")
    assert prepared.record["runtime"]["providers"] == ["CPUExecutionProvider"]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == FALLBACK]
    assert lines == [
        (logging.INFO, "no GPU here; serving on the CPU (cuda in model.providers needs one)")
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.skipif(gpu.present(), reason="a GPU is here: CUDA may start")
def test_gpu_machine_where_cuda_fails_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu, "present", lambda: True)
    config = _config(tmp_path, '["cuda", "cpu"]')
    with caplog.at_level(logging.INFO):
        prepare(load_config(config, environ={}), "w")
    [(level, line)] = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == FALLBACK]
    assert level == logging.WARNING
    assert line.startswith("provider cuda cannot start on this machine, which has a GPU (CUDA")
    assert line.endswith("serving with CPUExecutionProvider")


@pytest.mark.parametrize(
    ("has_gpu", "level", "words"),
    [
        (False, logging.INFO, "no GPU here; serving on the CPU"),
        (True, logging.WARNING, "this onnxruntime build lacks it: install onnxruntime-gpu"),
    ],
)
def test_onnxruntime_without_cuda_is_reported_once_at_the_level_the_machine_calls_for(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    has_gpu: bool,
    level: int,
    words: str,
) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    monkeypatch.setattr(gpu, "present", lambda: has_gpu)
    config = _config(tmp_path, '["cuda", "cpu"]')
    with caplog.at_level(logging.INFO):
        prepare(load_config(config, environ={}), "w")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "cuda" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0][0] == level
    assert words in lines[0][1]


@pytest.mark.skipif(gpu.present(), reason="a GPU is here: CUDA may start")
@pytest.mark.parametrize("providers", ['["cuda"]', '["tensorrt", "cuda"]'])
def test_providers_without_cpu_refuse_to_serve_on_the_cpu(
    tmp_path: Path, providers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, providers)
    with pytest.raises(ConfigError) as info:
        prepare(load_config(config, environ={}), "w")
    message = str(info.value)
    assert message.startswith(f"Config 'model.providers' is {providers}, with no \"cpu\" to ")
    assert "cannot start on this machine (it has no GPU)" in message
    assert 'Add "cpu" to model.providers to serve on the CPU, or run the worker where CUDA' in (
        message
    )
    assert "\n" not in message


@pytest.mark.skipif(gpu.present(), reason="a GPU is here: CUDA may start")
def test_cuda_alone_exits_2_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(_config(tmp_path, '["cuda"]')), "--check"]) == 2
    captured = capsys.readouterr()
    [line] = [x for x in captured.err.splitlines() if " ERROR " in x]
    assert "Config 'model.providers' is [\"cuda\"]" in line
    assert captured.out == ""  # no record: nothing was served


@pytest.mark.skipif(gpu.present(), reason="a GPU is here: CUDA may start")
def test_require_still_names_the_provider_table_when_cpu_is_not_listed(tmp_path: Path) -> None:
    config = _config(tmp_path, '["cuda"]', extra="[model.cuda]\nrequire = true")
    with pytest.raises(ModelError, match=r"'cuda' is required \(model.cuda.require = true\)"):
        prepare(load_config(config, environ={}), "w")


def test_gpu_test_finds_no_gpu_without_device_files_or_a_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpu, "_device_files", lambda: False)
    monkeypatch.setattr(gpu.ctypes, "CDLL", _no_library)
    assert gpu.present() is False
    monkeypatch.setattr(gpu, "_device_files", lambda: True)
    assert gpu.present() is True


def _no_library(name: str) -> None:
    raise OSError(f"{name}: cannot open shared object file")


_POST = "    def postprocess(self, outputs, inputs):\n        return outputs\n"


@pytest.mark.parametrize(("body", "has_post"), [("", False), (_POST, True)])
def test_the_pipeline_record_says_whether_the_handler_postprocesses(
    tmp_path: Path, body: str, has_post: bool
) -> None:
    """``redbatch status`` tells what replies of undeclared outputs hold from this field."""
    from worker.config.settings import PipelineConfig
    from worker.pipeline.handler import load_handler

    (tmp_path / "fithandler.py").write_text(
        "class H:\n"
        '    inputs = {"x": {"dtype": "float32", "shape": [-1, 2]}}\n'
        "    def preprocess(self, inputs):\n        return inputs\n" + body
    )
    handler = load_handler(PipelineConfig(handler="fithandler:H"), tmp_path)
    assert handler.record()["postprocess"] is has_post
