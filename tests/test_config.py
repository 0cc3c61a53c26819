"""Config errors stop the worker before it touches Redis, naming the dotted key and the fix."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest
import redis
from harness import write_config

from tools.synthetic import save
from worker.cli import main
from worker.config import (
    BatchingConfig,
    DeliveryConfig,
    LimitsConfig,
    MetricsConfig,
    ProviderConfig,
    RedisConfig,
    WarmupConfig,
    load_config,
    parse_config,
)
from worker.errors import ConfigError, ModelError
from worker.service import prepare

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
        ({"model_extra": {"path": "."}}, ["'model.path'", "which is not a file"]),
        ({"model_extra": {"version": ""}}, ["'model.version'", "non-empty printable"]),
        ({"model_extra": {"version": " "}}, ["'model.version'", "non-empty printable"]),
        ({"model_extra": {"version": "2\n3"}}, ["'model.version'", "non-empty printable"]),
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
    """tests/test_worker_fit.py checks its level: INFO without a GPU, WARNING with one."""
    config = write_config(tmp_path, "demo", redis_url)
    text = config.read_text().replace('providers = ["cpu"]', 'providers = ["cuda", "cpu"]')
    config.write_text(text)
    with caplog.at_level(logging.INFO):
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

    from worker.model import session as model

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
    from worker.model import session as model

    calls: list[object] = []
    monkeypatch.setattr(model, "preload_cuda_libraries", calls.append)
    config = write_config(tmp_path, "demo", redis_url)
    prepare(load_config(config, environ={}), "w")
    assert calls == []  # a CPU worker never touches CUDA libraries
    config.write_text(config.read_text().replace('["cpu"]', '["cuda", "cpu"]'))
    prepare(load_config(config, environ={}), "w")
    assert len(calls) == 1


# -- input bounds: one-sided, huge and infinite bounds warm up; NaN and empty ranges refused --

_BOUNDS = [
    {"min": 5.0},
    {"max": -1.0},
    {"min": -float("inf")},
    {"max": float("inf")},
    {"min": -1e308, "max": 1e308},
    {"min": 1e308},
    {"max": -1e308},
    {"min": 0.0},
    {"max": 0.0},
    {"min": 2.5, "max": 3.5},
    {"min": -3.0, "max": 70_000.0},
]


def _schema(model_dir: Path, dtype: str, bounds: dict):
    import numpy as np

    from worker.model.schema import Schema
    from worker.model.session import TensorSpec

    config = _parse(model_dir, inputs={"x": bounds})
    inputs = (TensorSpec("x", np.dtype(dtype), ("N", 3)),)
    outputs = (TensorSpec("y", np.dtype("float32"), ("N",)),)
    return Schema(inputs, outputs, config)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int64", "uint64"])
@pytest.mark.parametrize("bounds", _BOUNDS)
def test_warmup_inputs_pass_the_checks_for_any_allowed_bounds(
    model_dir: Path, dtype: str, bounds: dict
) -> None:
    import numpy as np

    from worker.model.schema import ValidRequest

    info = np.finfo(dtype) if dtype.startswith("float") else np.iinfo(dtype)
    if bounds.get("min", 0.0) > float(info.max) or bounds.get("max", 0.0) < float(info.min):
        with pytest.raises(ConfigError, match="admits no value of input 'x'"):
            _schema(model_dir, dtype, bounds)  # no value of the dtype could pass
        return
    schema = _schema(model_dir, dtype, bounds)
    feeds = schema.synthetic_feeds(32)
    assert feeds["x"].shape == (32, 3)
    assert feeds["x"].dtype == dtype
    request = ValidRequest(feeds, 32, ((3,),), ("y",))
    assert schema.screen(feeds, [request]) == {}


@pytest.mark.parametrize(
    ("dtype", "bounds", "key"),
    [
        ("float32", {"min": 1e39}, "'inputs.x.min'"),
        ("float16", {"max": -1e5}, "'inputs.x.max'"),
        ("int64", {"min": 0.2, "max": 0.8}, "'inputs.x.min'"),
        ("uint8", {"max": -1.0}, "'inputs.x.max'"),
        ("int8", {"min": 200.0}, "'inputs.x.min'"),
    ],
)
def test_a_range_no_value_of_the_dtype_passes_is_a_config_error(
    model_dir: Path, dtype: str, bounds: dict, key: str
) -> None:
    with pytest.raises(ConfigError, match="admits no value") as info:
        _schema(model_dir, dtype, bounds)
    assert key in str(info.value)
    assert "\n" not in str(info.value)


def test_float_bounds_equal_after_rounding_to_the_dtype_are_a_valid_range(model_dir: Path) -> None:
    schema = _schema(model_dir, "float32", {"min": 0.1, "max": 0.1})
    assert (schema.synthetic_feeds(4)["x"] == schema.synthetic_feeds(4)["x"].dtype.type(0.1)).all()


@pytest.mark.parametrize(
    "bounds",
    ["min = 5.0", "max = -1.0", "min = -inf", "min = -1e308\nmax = 1e308", "max = inf"],
)
def test_cli_check_warms_up_with_one_sided_and_unbounded_ranges(
    tmp_path: Path, bounds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = f"[inputs.features]\n{bounds}"
    config = write_config(tmp_path, "demo", "redis://127.0.0.1:1/0", extra=extra)
    assert main(["--config", str(config), "--check"]) == 0
    assert '"sha256"' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("bounds", "words"),
    [
        ({"min": float("nan")}, ["'inputs.x.min'", "nan", "finite"]),
        ({"max": float("nan")}, ["'inputs.x.max'", "nan", "finite"]),
        ({"min": float("inf")}, ["'inputs.x.min'", "no value would pass"]),
        ({"max": -float("inf")}, ["'inputs.x.max'", "no value would pass"]),
        ({"min": 1.0, "max": -1.0}, ["'inputs.x.min'", "Swap"]),
    ],
)
def test_nan_and_wrong_way_infinite_bounds_are_refused(
    model_dir: Path, bounds: dict, words: list
) -> None:
    with pytest.raises(ConfigError) as info:
        _parse(model_dir, inputs={"x": bounds})
    for word in words:
        assert word in str(info.value)


def test_an_infinite_bound_on_its_own_side_is_no_bound(model_dir: Path) -> None:
    inf = float("inf")
    cfg = _parse(model_dir, inputs={"x": {"min": -inf, "max": inf}}).inputs["x"]
    assert (cfg.min, cfg.max) == (None, None)


def test_cli_nan_bound_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = "[inputs.features]\nmin = nan"
    config = write_config(tmp_path, "demo", "redis://127.0.0.1:1/0", extra=extra)
    assert main(["--config", str(config), "--check"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1
    assert "'inputs.features.min'" in errors[0]
    assert "Traceback" not in err


# -- numbers and durations: finite, and at most a day where a long one breaks the worker --


@pytest.mark.parametrize(
    ("tables", "words"),
    [
        ({"delivery": {"claim_idle_ms": 100_000_000_000_000}}, ["'delivery.claim_idle_ms'"]),
        ({"delivery": {"claim_idle_ms": 86_400_001}}, ["'delivery.claim_idle_ms'", "86400000"]),
        ({"delivery": {"max_run_s": 86_401}}, ["'delivery.max_run_s'", "86400"]),
        ({"delivery": {"max_run_s": float("inf")}}, ["'delivery.max_run_s'", "finite"]),
        ({"delivery": {"max_run_s": float("nan")}}, ["'delivery.max_run_s'", "finite"]),
        ({"batching": {"max_wait_ms": float("nan")}}, ["'batching.max_wait_ms'", "finite"]),
    ],
)
def test_durations_are_finite_and_bounded(model_dir: Path, tables: dict, words: list) -> None:
    with pytest.raises(ConfigError) as info:
        _parse(model_dir, **tables)
    for word in words:
        assert word in str(info.value)


def test_a_day_is_still_accepted(model_dir: Path) -> None:
    delivery = _parse(
        model_dir, delivery={"claim_idle_ms": 86_400_000, "max_run_s": 86_400}
    ).delivery
    assert (delivery.claim_idle_ms, delivery.max_run_s) == (86_400_000, 86_400.0)


# -- redis.url: parsed the way redis-py reads it, at config time, never echoing a password --


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis://127.0.0.1:notaport/0", ["port"]),
        ("redis://h:99999/0", ["port"]),
        ("redis://h:0/0", ["port"]),
        ("redis://h/abc", ["database", "/0"]),
        ("redis://h/-1", ["database"]),
        ("redis://h/0?db=x", ["'db'"]),
        ("redis://h/0?foo=1", ["'foo'"]),
        ("redis://h/0?ssl_cert_reqs=none", ["'ssl_cert_reqs'"]),  # a rediss:// option
        ("redis://h/0?protocol=4", ["protocol"]),
        ("unix://", ["path"]),
        ("redis://[::1/0", ["IPv6"]),
        ("redis://user:s3cret@h:x/0", ["port", "***@h:x/0", "percent-encoded"]),
        ("redis://:s3/cret@h/0", ["port", "percent-encoded"]),
        ("redis://h/0?password=s3cret&foo=1", ["'foo'"]),
        ("http://user:s3cret@h", ["redis://"]),
    ],
)
def test_bad_redis_url_is_a_config_error_without_the_password(
    model_dir: Path, url: str, words: list
) -> None:
    for environ, key in (({}, "Config 'redis.url'"), ({"REDIS_URL": url}, "REDIS_URL")):
        path = model_dir / "c.toml"
        path.write_text(
            f"[redis]\nurl = {url!r}\n[model]\nname = 'demo'\npath = 'm.onnx'\n"
            if not environ
            else "[model]\nname = 'demo'\npath = 'm.onnx'\n"
        )
        with pytest.raises(ConfigError) as info:
            load_config(path, environ=environ)
        message = str(info.value)
        assert message.startswith(key) or key in message.split(" has value", maxsplit=1)[0]
        assert "'redis.url'" in message
        assert "s3" not in message
        assert "cret" not in message
        assert "\n" not in message
        for word in words:
            assert word in message


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://h",
        "redis://h:6380/",
        "rediss://user:p%40ss@h:6380/15?protocol=3&ssl_cert_reqs=none",
        "redis://[::1]:6379/1?socket_timeout=2.5",
        "unix:///run/redis.sock?db=2",
    ],
)
def test_good_redis_urls_are_accepted(model_dir: Path, url: str) -> None:
    assert _parse(model_dir, redis={"url": url}).redis.url == url


def test_cli_malformed_redis_url_exits_2_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:

    def no_prepare(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("worker.fleet.loading.prepare", no_prepare)
    monkeypatch.setenv("REDIS_URL", "redis://user:s3cret@127.0.0.1:notaport/0")
    config = write_config(tmp_path, "demo", "redis://127.0.0.1:1/0")
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1
    assert "REDIS_URL" in errors[0]
    assert "port" in errors[0]
    assert "s3cret" not in err
    assert "Traceback" not in err


def test_a_bound_past_the_dtype_range_passes_every_finite_value_but_not_infinity(
    model_dir: Path,
) -> None:
    # With non-finite values allowed, min = -1e39 on float32 still keeps -inf out (and the
    # check never overflows casting the bound to float32)
    import numpy as np

    from worker.model.schema import Schema, ValidRequest
    from worker.model.session import TensorSpec

    config = _parse(
        model_dir,
        inputs={"x": {"min": -1e39, "max": 1e39}},
        limits={"reject_non_finite": False},
    )
    inputs = (TensorSpec("x", np.dtype("float32"), ("N", 3)),)
    schema = Schema(inputs, (TensorSpec("y", np.dtype("float32"), ("N",)),), config)
    top = np.finfo(np.float32).max
    feeds = {"x": np.array([[-top, top, 0.0], [-np.inf, 0.0, 0.0], [0.0, np.nan, 0.0]], np.float32)}
    requests = [ValidRequest({"x": feeds["x"][i : i + 1]}, 1, ((3,),), ("y",)) for i in range(3)]
    with np.errstate(all="raise"):
        rejected = schema.screen(feeds, requests)
    assert sorted(rejected) == [1]  # -inf is below the bound; NaN is let through, as asked


def test_one_requests_nan_does_not_wave_another_requests_out_of_range_value_through(
    model_dir: Path,
) -> None:
    # min() of a batch holding a NaN is NaN, which compares false: every value passed
    import numpy as np

    from worker.model.schema import Schema, ValidRequest
    from worker.model.session import TensorSpec

    config = _parse(model_dir, inputs={"x": {"min": 0.0}}, limits={"reject_non_finite": False})
    inputs = (TensorSpec("x", np.dtype("float32"), ("N", 3)),)
    schema = Schema(inputs, (TensorSpec("y", np.dtype("float32"), ("N",)),), config)
    feeds = {"x": np.array([[np.nan, 1.0, 1.0], [-5.0, 1.0, 1.0]], np.float32)}
    requests = [ValidRequest({"x": feeds["x"][i : i + 1]}, 1, ((3,),), ("y",)) for i in range(2)]
    rejected = schema.screen(feeds, requests)
    assert sorted(rejected) == [1]
    assert "below the minimum 0" in rejected[1].message


def test_inputs_with_different_fixed_leading_sizes_name_the_inputs_key_and_fix(
    tmp_path: Path, redis_url: str
) -> None:
    # Silero VAD's fixed-batch export: audio [1, 576] and state [2, 1, 128] (batch on axis 1)
    onnx = pytest.importorskip("onnx")
    f32 = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Identity", ["input"], ["output"]),
            onnx.helper.make_node("Identity", ["state"], ["stateN"]),
        ],
        "silero_fixed",
        [
            onnx.helper.make_tensor_value_info("input", f32, [1, 576]),
            onnx.helper.make_tensor_value_info("state", f32, [2, 1, 128]),
        ],
        [
            onnx.helper.make_tensor_value_info("output", f32, [1, 576]),
            onnx.helper.make_tensor_value_info("stateN", f32, [2, 1, 128]),
        ],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, tmp_path / "vad.onnx")
    config = tmp_path / "vad.toml"
    config.write_text(
        f'[redis]\nurl = "{redis_url}"\n[model]\nname = "vad"\npath = "vad.onnx"\n'
        'providers = ["cpu"]\n[batching]\nmax_batch_size = 1\n'
    )
    with pytest.raises(ModelError) as caught:
        prepare(load_config(config, environ={}), "w")
    message = str(caught.value)
    assert "\n" not in message
    for words in (
        "'input' [1, 576] has 1 on axis 0",
        "'state' [2, 1, 128] has 2 on axis 0",
        "batching.max_batch_size <= K",
        "Set each input's batch_axis",
    ):
        assert words in message


def test_left_out_keys_take_the_dataclass_defaults(model_dir: Path) -> None:
    config = parse_config(
        {"model": {"name": "demo", "path": "m.onnx", "cpu": {}}}, base_dir=model_dir
    )
    assert config.redis == RedisConfig()
    assert config.model.version == "1"
    assert config.model.providers == (ProviderConfig("cpu"),)
    assert (config.model.intra_op_threads, config.model.allow_spinning) == (0, False)
    assert config.batching == BatchingConfig()
    assert config.limits == LimitsConfig()
    assert config.delivery == DeliveryConfig()
    assert config.warmup == WarmupConfig()
    assert config.metrics == MetricsConfig()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ('[inputs.features]\nbatch_axis = "last"', "'inputs.features.batch_axis' has value 'last'"),
        ("[inputs.features]\nbatch_axis = -1", "'inputs.features.batch_axis' has value -1"),
        ('[outputs.probs]\nbatch_axis = "row"', "'outputs.probs.batch_axis'"),
        ("[outputs.probs]\naxis = 1", "'outputs.probs.axis' is not known"),
        ('[pipeline]\nhandler = "h:X"\nthreads = 0', "'pipeline.threads'"),
        ('[pipeline]\nhandler = "h:X"\noptions = 3', "'pipeline.options' has value 3"),
        ('[pipeline]\nhandler = "h"', "Use module:attribute"),
        ("[pipeline]\nthreads = 2", "needs 'pipeline.handler'"),
        ("[limits]\nmax_element_bytes = 0", "'limits.max_element_bytes'"),
    ],
)
def test_v2_keys_refuse_bad_values_naming_the_key(model_dir: Path, extra: str, words: str) -> None:
    data = tomllib.loads(f'[model]\nname = "demo"\npath = "m.onnx"\n{extra}')
    with pytest.raises(ConfigError) as caught:
        parse_config(data, base_dir=model_dir)
    assert words in str(caught.value)


def test_an_outputs_table_naming_no_model_output_is_refused(tmp_path: Path, redis_url: str) -> None:
    config = write_config(tmp_path, "demo", redis_url, extra="[outputs.prob]\nbatch_axis = 1")
    with pytest.raises(ConfigError, match=r"\[outputs.prob\] names no model output.*probs"):
        prepare(load_config(config, environ={}), "w")


def test_reference_config_documents_the_v2_keys() -> None:
    text = (ROOT / "configs" / "reference.toml").read_text()
    for key in ("max_element_bytes", "batch_axis", "[pipeline]", "timeout_s", "[outputs."):
        assert key in text


def test_a_bad_value_in_a_part_of_a_split_request_is_placed_by_the_whole_requests_row(
    model_dir: Path,
) -> None:
    # A request's rows split across batches (worker/answer/parts.py): its tail starts at row 30
    import numpy as np

    from worker.model.schema import Schema, ValidRequest
    from worker.model.session import TensorSpec

    config = _parse(model_dir, inputs={"x": {"min": 0.0}})
    inputs = (TensorSpec("x", np.dtype("float32"), ("N", 3)),)
    schema = Schema(inputs, (TensorSpec("y", np.dtype("float32"), ("N",)),), config)
    feeds = {"x": np.array([[1.0, 1.0, 1.0], [1.0, -5.0, 1.0]], np.float32)}
    tail = ValidRequest({"x": feeds["x"]}, 2, ((3,),), ("y",), first_row=30)
    rejected = schema.screen(feeds, [tail])
    assert "at [31, 1] is below the minimum 0" in rejected[0].message
