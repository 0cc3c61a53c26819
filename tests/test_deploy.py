"""The deployment files: Kubernetes manifests, KEDA, compose, Prometheus and the dashboard.

Every built-in Kubernetes object is validated against the API schemas of recent releases
(kubernetes-validate, strict: unknown fields fail). KEDA's objects are CRDs that it has no schema
for, so they are checked against a small JSON schema of the fields we rely on, plus the links
between files (names, keys, ports) that a typo would break without any validator noticing.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema  # a dependency of kubernetes-validate
import kubernetes_validate
import pytest
import yaml

from producer.protocol import keys
from producer.protocol.lanes import CLASSES, Lane, lane_stream, parse_lane
from tools.synthetic import save
from worker.config import parse_config
from worker.ops.metrics import Metrics, MetricsServer

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
K8S_VERSIONS = ("1.31.0", "1.36.0")
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _docs(path):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def _builtin() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{path.name}:{doc['kind']}", doc)
        for path in sorted(K8S.glob("*.yaml"))
        for doc in _docs(path)
        if doc["kind"] not in KEDA_KINDS
    ]


def _container(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    pod = objects[("Deployment", "redbatch-worker")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container


def _worker_toml(objects: dict[tuple[str, str], dict[str, Any]]) -> str:
    return objects[("ConfigMap", "redbatch-worker-config")]["data"]["worker.toml"]


# ---------------------------------------------------------------------------------------------
# Kubernetes


def test_the_manifests_hold_the_objects_the_docs_name() -> None:
    assert set(_objects()) == {
        ("ConfigMap", "redbatch-worker-config"),
        ("Deployment", "redbatch-worker"),
        ("Secret", "redbatch-redis"),
        ("Service", "redbatch-worker-metrics"),
        ("TriggerAuthentication", "redbatch-redis"),
        ("ScaledObject", "redbatch-worker"),
        # keda-cluster.yaml: the Redis Cluster variant, applied instead of keda.yaml
        ("TriggerAuthentication", "redbatch-redis-cluster"),
        ("ScaledObject", "redbatch-worker-cluster"),
    }


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("where", "doc"), _builtin(), ids=[w for w, _ in _builtin()])
def test_builtin_objects_validate_strictly(version: str, where: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_catches_a_misspelt_field() -> None:
    deployment = copy.deepcopy(_objects()[("Deployment", "redbatch-worker")])
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_deployment_wires_config_secret_probes_and_gpu() -> None:
    objects = _objects()
    deployment = objects[("Deployment", "redbatch-worker")]
    pod = deployment["spec"]["template"]["spec"]
    container = _container(objects)
    config = tomllib.loads(_worker_toml(objects))
    port = config["metrics"]["port"]

    # Given the ConfigMap mounted at /app/configs, the worker reads the file it holds.
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/app/configs")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "redbatch-worker-config"
    args = container["args"]
    assert args[args.index("--config") + 1] == "/app/configs/worker.toml"

    # REDIS_URL comes from a key the Secret has.
    env = {e["name"]: e for e in container["env"]}
    ref = env["REDIS_URL"]["valueFrom"]["secretKeyRef"]
    secret = objects[("Secret", ref["name"])]
    assert ref["key"] in secret["stringData"]

    # The probes and the Service reach the port the config serves metrics on.
    (named,) = container["ports"]
    assert named == {"name": "metrics", "containerPort": port, "protocol": "TCP"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    service = objects[("Service", "redbatch-worker-metrics")]
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["ports"][0]["port"] == port

    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "replicas" not in deployment["spec"]  # KEDA owns the count
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert 30 <= pod["terminationGracePeriodSeconds"] <= 300
    assert "lifecycle" not in container  # SIGTERM drains; no preStop


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    return labels


def test_configmap_holds_a_config_the_worker_accepts(tmp_path: Path) -> None:
    # Given the demo model where the image keeps it, the ConfigMap's file parses cleanly.
    text = _worker_toml(_objects())
    assert 'path = "/app/models/demo.onnx"' in text  # absolute: ConfigMap files are symlinks
    model = tmp_path / "demo.onnx"
    save("demo", model)
    data = tomllib.loads(text.replace("/app/models/demo.onnx", str(model)))
    config = parse_config(data, base_dir=tmp_path, redis_url=None)
    assert config.metrics.port == 9100
    assert config.model.name == "demo"


# ---------------------------------------------------------------------------------------------
# KEDA

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_REF = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1}},
}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "labels": _STRING_MAP},
}
SCALED_OBJECT_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers", "minReplicaCount", "maxReplicaCount"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": _REF,
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "horizontalPodAutoscalerConfig": {"type": "object"},
                        # KEDA 2.12+: one composite metric from the triggers' values
                        "scalingModifiers": {
                            "type": "object",
                            "required": ["formula", "target"],
                            "additionalProperties": False,
                            "properties": {
                                "formula": {"type": "string", "minLength": 1},
                                "target": {"type": "string", "pattern": r"^[0-9]+$"},
                                "activationTarget": {"type": "string"},
                                "metricType": {"enum": ["AverageValue", "Value"]},
                            },
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"enum": ["redis-streams", "redis-cluster-streams"]},
                            "name": {"type": "string"},
                            "metadata": _STRING_MAP,  # KEDA reads every value as a string
                            "authenticationRef": _REF,
                        },
                    },
                },
            },
        },
    },
}
TRIGGER_AUTH_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "TriggerAuthentication"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["secretTargetRef"],
            "properties": {
                "secretTargetRef": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["parameter", "name", "key"],
                        "additionalProperties": False,
                        "properties": {
                            "parameter": {
                                "enum": [
                                    "address",
                                    "addresses",
                                    "host",
                                    "port",
                                    "username",
                                    "password",
                                ]
                            },
                            "name": {"type": "string"},
                            "key": {"type": "string"},
                        },
                    },
                }
            },
        },
    },
}


def test_keda_objects_match_the_fields_we_rely_on() -> None:
    objects = _objects()
    for name in ("redbatch-worker", "redbatch-worker-cluster"):
        jsonschema.validate(objects[("ScaledObject", name)], SCALED_OBJECT_SCHEMA)
    for name in ("redbatch-redis", "redbatch-redis-cluster"):
        jsonschema.validate(objects[("TriggerAuthentication", name)], TRIGGER_AUTH_SCHEMA)


def test_the_keda_schema_catches_a_misspelt_scaling_modifier() -> None:
    scaled = copy.deepcopy(_objects()[("ScaledObject", "redbatch-worker-cluster")])
    modifiers = scaled["spec"]["advanced"]["scalingModifiers"]
    modifiers["fromula"] = modifiers.pop("formula")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, SCALED_OBJECT_SCHEMA)


def test_keda_scales_the_worker_on_the_request_streams_length() -> None:
    objects = _objects()
    scaled = objects[("ScaledObject", "redbatch-worker")]["spec"]
    assert ("Deployment", scaled["scaleTargetRef"]["name"]) in objects
    assert 1 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]

    trigger = _class_triggers(scaled)["normal"]
    assert trigger["type"] == "redis-streams"
    meta = trigger["metadata"]
    config = tomllib.loads(_worker_toml(objects))
    stream = keys.request_stream(config["redis"]["prefix"], config["model"]["name"])
    assert meta["stream"] == stream
    # No consumer group: KEDA reads XLEN, which is lag plus pending here (entries are deleted
    # when answered), rather than lag alone or pending alone.
    assert "consumerGroup" not in meta
    assert "lagCount" not in meta
    assert "pendingEntriesCount" not in meta
    per_replica = int(meta["streamLength"])
    # Above what one busy worker holds in hand (about six batches), so steady traffic through
    # one worker does not ask for a second.
    assert per_replica > 6 * config["batching"]["max_batch_size"]

    # The address and password come from keys the Secret has.
    auth = objects[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["key"] in objects[("Secret", ref["name"])]["stringData"]
    assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} == {"address", "password"}

    # docs/operations.md quotes the numbers the manifest uses.
    doc = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    for number in (meta["streamLength"], str(scaled["maxReplicaCount"])):
        assert re.search(rf"\b{number}\b", doc), number


def _lane_of(stream: str, prefix: str, model: str) -> Lane:
    """The lane a trigger's stream is, on a shard of ``model``; fails on any other key."""
    found = _STREAM_RE.fullmatch(stream)
    assert found, stream
    assert found["prefix"] == prefix, stream
    tag = found["tag"]
    assert keys.is_valid_tag(tag), stream
    assert keys.model_of(tag) == model, stream
    lane = parse_lane(prefix, tag, stream)
    assert lane is not None, stream
    assert lane_stream(prefix, tag, lane.cls, lane.tenant) == stream
    return lane


def _class_triggers(scaled: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """keda.yaml's triggers by the class of the lane each reads: one per class, no tenant."""
    objects = _objects()
    config = tomllib.loads(_worker_toml(objects))
    prefix, model = config["redis"]["prefix"], config["model"]["name"]
    by_class = {}
    for trigger in scaled["triggers"]:
        lane = _lane_of(trigger["metadata"]["stream"], prefix, model)
        assert lane.tag == model, trigger["name"]
        assert lane.tenant is None, trigger["name"]
        assert trigger["name"] == lane.cls  # named after its class
        by_class[lane.cls] = trigger
    assert sorted(by_class) == sorted(CLASSES)
    assert len(scaled["triggers"]) == len(CLASSES)
    return by_class


def test_keda_scales_each_class_on_its_own_lane_high_first() -> None:
    objects = _objects()
    scaled = objects[("ScaledObject", "redbatch-worker")]["spec"]
    triggers = _class_triggers(scaled)
    per_replica = {cls: int(t["metadata"]["streamLength"]) for cls, t in triggers.items()}
    # Interactive work scales sooner than normal, batch jobs later.
    assert per_replica["high"] < per_replica["normal"] < per_replica["low"]
    for cls, trigger in triggers.items():
        assert trigger["type"] == "redis-streams", cls
        meta = trigger["metadata"]
        for absent in ("consumerGroup", "lagCount", "pendingEntriesCount"):
            assert absent not in meta, (cls, absent)  # XLEN of each lane, as for normal
        assert trigger["authenticationRef"] == triggers["normal"]["authenticationRef"]
        assert meta["databaseIndex"] == triggers["normal"]["metadata"]["databaseIndex"]
    # The file says tenant lanes need their own triggers, and sketches the Prometheus one on the
    # workers' backlog metric with the labels the workers export per lane.
    text = (K8S / "keda.yaml").read_text(encoding="utf-8")
    assert "Tenant lanes" in text
    assert "# - type: prometheus" in text
    assert "max by (shard, class, tenant)" in text
    doc = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    for cls, number in per_replica.items():
        assert re.search(rf"\b{number:,}\b|\b{number}\b", doc), (cls, number)


_STREAM_RE = re.compile(r"(?P<prefix>[^{}\s]+):\{(?P<tag>[^{}]+)\}:requests(:[^{}\s]+)?")
_ADDRESS_RE = re.compile(r"[A-Za-z0-9.-]+:[0-9]{1,5}")


def _formula_names(formula: str) -> list[str]:
    """The trigger names the formula names, in order; fails on anything but names, numbers,
    ``+ * /`` and parentheses (a weighted sum)."""
    assert re.fullmatch(r"[A-Za-z_0-9+*/() .]+", formula), formula
    return re.findall(r"[A-Za-z_]\w*", formula)


def _formula_value(formula: str, values: dict[str, float]) -> float:
    """The formula evaluated with each trigger's value (checked first by ``_formula_names``)."""
    names = _formula_names(formula)
    assert set(names) <= set(values), set(names) - set(values)
    return float(eval(formula, {"__builtins__": {}}, dict(values)))


def test_keda_cluster_sums_one_trigger_per_shard() -> None:
    objects = _objects()
    single = objects[("ScaledObject", "redbatch-worker")]["spec"]
    scaled = objects[("ScaledObject", "redbatch-worker-cluster")]["spec"]
    config = tomllib.loads(_worker_toml(objects))
    prefix, model = config["redis"]["prefix"], config["model"]["name"]

    # The same Deployment, bounds and HPA behaviour as keda.yaml: only the metric differs.
    assert scaled["scaleTargetRef"] == single["scaleTargetRef"]
    for key in ("pollingInterval", "minReplicaCount", "maxReplicaCount", "cooldownPeriod"):
        assert scaled[key] == single[key], key
    assert (
        scaled["advanced"]["horizontalPodAutoscalerConfig"]
        == single["advanced"]["horizontalPodAutoscalerConfig"]
    )

    triggers = scaled["triggers"]
    assert len(triggers) >= 2
    single_by_class = _class_triggers(single)
    lanes: dict[str, Lane] = {}
    for trigger in triggers:
        assert trigger["type"] == "redis-cluster-streams", trigger
        assert re.fullmatch(r"[A-Za-z_]\w*", trigger["name"]), trigger  # a name expr can use
        meta = trigger["metadata"]
        # Every trigger names a lane stream of a shard of this model: P:{T}:requests (normal)
        # or P:{T}:requests:high / :low, no tenant.
        lane = _lane_of(meta["stream"], prefix, model)
        assert lane.tenant is None, meta["stream"]
        lanes[trigger["name"]] = lane
        # XLEN of each stream, as in keda.yaml (no consumer group: lag plus pending).
        for absent in ("consumerGroup", "lagCount", "pendingEntriesCount"):
            assert absent not in meta, (trigger["name"], absent)
        assert meta["streamLength"] == single_by_class[lane.cls]["metadata"]["streamLength"]
        addresses = meta["addresses"].split(",")
        assert addresses, trigger["name"]
        assert all(_ADDRESS_RE.fullmatch(a.strip()) for a in addresses), addresses
        assert meta["enableTLS"] in ("true", "false")
        auth = objects[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in objects[("Secret", ref["name"])]["stringData"]
    tags = [lane.tag for lane in lanes.values() if lane.cls == "normal"]
    assert tags[0] == model  # the model's own shard, which always exists
    assert len(set(tags)) == len(tags)
    # Every class on every shard, each once.
    assert sorted((ln.tag, ln.cls) for ln in lanes.values()) == sorted(
        (tag, cls) for tag in tags for cls in CLASSES
    )
    names = [t["name"] for t in triggers]
    assert len(set(names)) == len(names)

    # The formula names every trigger, each once: the model's backlog over all its shards,
    # each lane's entries weighed as keda.yaml's entries per replica for its class say.
    modifiers = scaled["advanced"]["scalingModifiers"]
    assert sorted(_formula_names(modifiers["formula"])) == sorted(names)
    assert modifiers["metricType"] == "AverageValue"
    target = int(modifiers["target"])
    assert target == int(single_by_class["normal"]["metadata"]["streamLength"])
    for name, lane in lanes.items():
        alone = {n: (1000.0 if n == name else 0.0) for n in names}
        per_replica = int(single_by_class[lane.cls]["metadata"]["streamLength"])
        assert _formula_value(modifiers["formula"], alone) == pytest.approx(
            1000.0 * target / per_replica
        ), name

    # docs/operations.md's example: 3 shards x 1,000 entries at 512 per replica.
    per_shard, shards = 1000, 3
    by_max = max(math.ceil(per_shard / target) for _ in range(shards))
    by_sum = math.ceil(per_shard * shards / target)
    assert (by_max, by_sum) == (2, 6)
    doc = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    assert "keda-cluster.yaml" in doc
    assert "scalingModifiers" in doc
    assert f"ceil(3000 / {target}) = {by_sum} replicas" in doc
    assert f"| {by_max} replicas |" in doc


# ---------------------------------------------------------------------------------------------
# compose and Prometheus


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text(encoding="utf-8"))
    return data


def _cluster_services() -> dict[str, dict[str, Any]]:
    """The services of compose's ``cluster`` profile (a six-node Redis Cluster and its users)."""
    services = _compose()["services"]
    return {n: s for n, s in services.items() if "cluster" in s.get("profiles", ())}


def _command_text(service: dict[str, Any]) -> str:
    command = service.get("command", "")
    return command if isinstance(command, str) else " ".join(map(str, command))


def test_compose_services_profiles_and_health_checks() -> None:
    everything = _compose()["services"]
    cluster = _cluster_services()
    services = {n: s for n, s in everything.items() if n not in cluster}
    assert set(services) == {"redis", "worker", "worker-gpu", "producer", "prometheus", "grafana"}
    profiles = {name: tuple(s.get("profiles", ())) for name, s in services.items()}
    assert profiles == {
        "redis": (),
        "worker": (),
        "worker-gpu": ("gpu",),
        "producer": ("demo",),
        "prometheus": ("observability",),
        "grafana": ("observability",),
    }

    redis = services["redis"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert "--appendonly yes" in redis["command"]
    assert "--maxmemory-policy noeviction" in redis["command"]
    assert "--maxmemory 1gb" in redis["command"]  # producers have a watermark to stop at

    for name in ("worker", "worker-gpu"):
        worker = services[name]
        test = worker["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]  # the slim image has no curl
        assert "http://127.0.0.1:9100/healthz" in test[3]
        assert worker["command"][:2] == ["--config", "${REDBATCH_CONFIG:-configs/compose.toml}"]
        assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
        assert worker["stop_grace_period"]
    assert services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"
    ] == ["gpu"]
    # The GPU worker's image carries CUDA and cuDNN; the Dockerfile installs them on that arg.
    gpu_build = services["worker-gpu"]["build"]
    assert gpu_build["args"] == {"ORT_EXTRAS": "cuda,cudnn"}
    assert services["worker-gpu"]["image"] != services["worker"]["image"]
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert 'ARG ORT_EXTRAS=""' in dockerfile
    assert 'pip install "onnxruntime-gpu[$ORT_EXTRAS]"' in dockerfile

    # Every port published on the host is on loopback only, the cluster profile's included.
    for service in everything.values():
        for port in service.get("ports", ()):
            assert str(port).startswith("127.0.0.1:"), port


def test_compose_leaves_a_local_redis_its_port_and_mounts_models_and_configs() -> None:
    """A developer's own Redis on 6379 does not stop `docker compose up`; a worker serves a model
    from ./models with a config from ./configs without an image build; the build context leaves
    out the checkout's .venv and fetched models (718 MB before)."""
    services = _compose()["services"]
    (port,) = services["redis"]["ports"]
    assert port == "127.0.0.1:${REDBATCH_REDIS_PORT:-6380}:6379"
    for name in ("worker", "worker-gpu", "worker-cluster"):
        volumes = services[name]["volumes"]
        assert "${REDBATCH_MODELS:-./models}:/models:ro" in volumes
        assert "./configs:/app/configs:ro" in volumes
    header = (ROOT / "compose.yaml").read_text(encoding="utf-8").split("services:")[0]
    assert "REDIS_URL=redis://127.0.0.1:6380/0" in header
    assert "REDBATCH_CONFIG=configs/mine.toml" in header

    ignored = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    assert ignored[ignored.index("*") :][:1] == ["*"]  # everything out, then what COPY needs back
    allowed = {line[1:].rstrip("/") for line in ignored if line.startswith("!")}
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    copied = set()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            copied.update(line.split()[1:-1])
    assert copied == allowed, (copied, allowed)
    assert not {".venv", "models", "tests", ".git"} & allowed


def test_compose_cluster_profile_runs_a_six_node_cluster() -> None:
    cluster = _cluster_services()
    if not cluster:
        pytest.skip("compose.yaml has no cluster profile yet")
    # docs/operations.md ("A local cluster") starts it with `docker compose --profile cluster`.
    doc = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    assert "--profile cluster" in doc
    for name, service in cluster.items():
        assert tuple(service["profiles"]) == ("cluster",), name  # never up without the profile
    nodes = [n for n, s in cluster.items() if "--cluster-enabled yes" in _command_text(s)]
    assert len(nodes) == 6, nodes  # three masters and three replicas
    for name in nodes:  # the same settings as the single Redis (docs/operations.md)
        command = _command_text(cluster[name])
        assert "--maxmemory-policy noeviction" in command, name


def test_compose_worker_config_serves_metrics_where_checks_and_scrapes_look(
    tmp_path: Path,
) -> None:
    text = (ROOT / "configs" / "compose.toml").read_text(encoding="utf-8")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "compose.toml").write_text(text, encoding="utf-8")
    save("demo", tmp_path / "models" / "demo.onnx")
    data = tomllib.loads(text)
    config = parse_config(data, base_dir=tmp_path / "configs", redis_url="redis://redis:6379/0")
    assert config.metrics.port == 9100

    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text(encoding="utf-8"))
    (job,) = prometheus["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    assert {"worker", "worker-gpu"} <= set(sd["names"])
    assert sd["port"] == config.metrics.port


def test_compose_mounts_the_rule_file_where_prometheus_yml_loads_it() -> None:
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text(encoding="utf-8"))
    volumes = _compose()["services"]["prometheus"]["volumes"]
    mounts = dict(v.removesuffix(":ro").split(":") for v in volumes if v.startswith("./"))
    assert prometheus["rule_files"] == [mounts["./deploy/prometheus-rules.yml"]]


def test_compose_observability_mounts_files_that_exist() -> None:
    compose = _compose()
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).is_file(), source
    assert (
        "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
        in (services["prometheus"]["volumes"])
    )
    dashboard_mount = next(v for v in services["grafana"]["volumes"] if "redbatch.json" in v)
    target_dir = str(Path(dashboard_mount.split(":")[1]).parent)
    provider = yaml.safe_load(compose["configs"]["grafana-dashboards"]["content"])
    assert provider["providers"][0]["options"]["path"] == target_dir
    datasource = yaml.safe_load(compose["configs"]["grafana-datasource"]["content"])
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    targets = {c["source"] for c in services["grafana"]["configs"]}
    assert targets == set(compose["configs"])


def test_worker_health_check_command_passes_only_while_healthz_answers() -> None:
    code = _compose()["services"]["worker"]["healthcheck"]["test"][3]
    server = MetricsServer(Metrics(), lambda: False, 0)
    server.start()
    probe = [sys.executable, "-c", code.replace(":9100/", f":{server.port}/")]
    try:
        assert subprocess.run(probe, check=False, capture_output=True, timeout=20).returncode == 0
    finally:
        server.close()
    assert subprocess.run(probe, check=False, capture_output=True, timeout=20).returncode != 0


# ---------------------------------------------------------------------------------------------
# Grafana


def _exported_names() -> set[str]:
    """Every series name the worker exports, as Prometheus stores it."""
    names = set()
    for family in Metrics().registry.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names |= {f"{family.name}_{s}" for s in ("bucket", "sum", "count")}
        elif family.type == "info":
            names.add(f"{family.name}_info")
        else:
            names.add(family.name)
    return names


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def test_dashboard_is_grafana_json_on_metrics_the_worker_exports() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "redbatch.json").read_text("utf-8"))
    assert isinstance(dashboard["schemaVersion"], int)
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] == "redbatch"
    assert dashboard["title"]
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))

    exported = _exported_names() | {"redbatch_backlog", "redbatch_pending", "redbatch_dead_letters"}
    used: set[str] = set()
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):  # no two panels share a grid cell
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bredbatch_[a-z_]+", target["expr"]))
            assert names, target["expr"]
            assert names <= exported, (panel["title"], names - exported)
            used |= names

    for needed in (
        "redbatch_requests_total",
        "redbatch_backlog",
        "redbatch_pending",
        "redbatch_dead_letters",
        "redbatch_batch_rows_bucket",
        "redbatch_queue_wait_seconds_bucket",
        "redbatch_decode_validate_seconds_sum",
        "redbatch_inference_seconds_bucket",
        "redbatch_reply_write_seconds_bucket",
        "redbatch_claims_total",
        "redbatch_lease_renewals_total",
        "redbatch_consumers_removed_total",
        "redbatch_backlog_oldest_age_seconds",
        "redbatch_redis_used_memory_bytes",
        "redbatch_redis_maxmemory_bytes",
        "redbatch_redis_memory_headroom_ratio",
    ):
        assert needed in used, needed


_SHARD_GAUGES = (
    "redbatch_backlog",
    "redbatch_pending",
    "redbatch_group_lag",
    "redbatch_dead_letters",
    "redbatch_backlog_oldest_age_seconds",
)


def _dashboard_targets() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "redbatch.json").read_text("utf-8"))
    return [(p, t) for p in _panels(dashboard) if p["type"] != "row" for t in p["targets"]]


# Gauges a worker reports per lane (labels shard, class, tenant: one series per lane stream)
# and per shard (its dead-letter stream is the shard's, whatever the lane).
_LANE_GAUGES = ("redbatch_backlog", "redbatch_pending", "redbatch_group_lag")


def test_dashboard_reads_the_stream_gauges_per_shard() -> None:
    # Every worker reports every shard and lane: a panel takes the largest report per lane
    # (shard, class, tenant; the dead letters per shard) first, never a sum over workers, which
    # would count each lane once per worker, nor a max per shard, which would keep one lane of
    # each; then sums the lanes (over all, or by shard, class or tenant), or, for the oldest
    # request, takes the largest.
    per_shard, per_class = [], []
    for panel, target in _dashboard_targets():
        expr = target["expr"]
        for name in _SHARD_GAUGES:
            for found in re.finditer(rf"\b{name}\b", expr):
                head = expr[: found.start()]
                if name == "redbatch_backlog_oldest_age_seconds":
                    assert re.search(r"max(?: by \((shard|class)\))? \($|max\($", head), expr
                    continue
                inner = "shard, class, tenant" if name in _LANE_GAUGES else "shard"
                # by model too, in the panels per model (a shard is one model's)
                inner = rf"(model, )?{inner}"
                assert re.search(rf"max by \({inner}\) \($", head), (panel["title"], expr)
                outer = r"(sum(?: by \((shard|class|class, tenant|model)\))? ?\()?"
                assert re.fullmatch(rf"{outer}max by \({inner}\) \(", head), expr
        if expr.startswith("sum by (shard) (max by (shard, class, tenant) (redbatch_backlog{"):
            per_shard.append((panel["title"], target["legendFormat"]))
        if re.search(r"\bby \((le, )?class\)", expr):
            per_class.append(panel["title"])
    assert per_shard == [("Backlog by shard", "{{shard}}")]
    # Panels per class: backlog, its oldest entry (the queue wait now) and the queue wait
    # histogram by class, whose worker labels the metric names stay the same for.
    assert {
        "Backlog by class",
        "Oldest request age by class",
        "Queue wait by class (p50, p99)",
    } <= (set(per_class))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_evaluates_the_dashboards_queries(tmp_path: Path) -> None:
    # Grafana's variables as it fills them with "All" and a short scrape interval.
    def fill(expr: str) -> str:
        return expr.replace("$__rate_interval", "1m").replace('"$job"', '".*"')

    targets = _dashboard_targets()
    rules = tmp_path / "dashboard-rules.yml"
    records = [
        {"record": f"dashboard:panel_{panel['id']}_{target['refId']}", "expr": fill(target["expr"])}
        for panel, target in targets
    ]
    rules.write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}), encoding="utf-8"
    )
    check = subprocess.run(
        ["promtool", "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr  # every query parses

    # Two workers, each reporting both shards of model demo (as workers do): 100 + 50 waiting,
    # shard demo~3's lag unknown (-1), 3 dead letters on demo~3 only.
    series = {}
    for instance in ("a", "b"):
        for shard, backlog, pending, lag, dead, age in (
            ("demo", 100, 30, 70, 0, 4),
            ("demo~3", 50, 20, -1, 3, 9),
        ):
            where = f'{{job="w",instance="{instance}",shard="{shard}"}}'
            for name, value in (
                ("redbatch_backlog", backlog),
                ("redbatch_pending", pending),
                ("redbatch_group_lag", lag),
                ("redbatch_dead_letters", dead),
                ("redbatch_backlog_oldest_age_seconds", age),
            ):
                series[name + where] = f"{value}x10"
    by_title = {panel["title"]: target for panel, target in targets if target["refId"] == "A"}
    expected = {
        "Backlog (XLEN, all shards)": [("{}", 150)],
        "Pending (held by workers)": [("{}", 50)],
        "Oldest request age": [("{}", 9)],
        "Dead letters": [("{}", 3)],
        "Backlog by shard": [('{shard="demo"}', 100), ('{shard="demo~3"}', 50)],
        "Oldest request age by shard": [('{shard="demo"}', 4), ('{shard="demo~3"}', 9)],
    }
    cases = [
        {
            "expr": fill(by_title[title]["expr"]),
            "eval_time": "1m",
            "exp_samples": [{"labels": labels, "value": value} for labels, value in samples],
        }
        for title, samples in expected.items()
    ]
    lag = next(t for _, t in targets if "redbatch_group_lag" in t["expr"])
    cases.append(
        {
            "expr": fill(lag["expr"]),
            "eval_time": "1m",
            "exp_samples": [{"labels": "{}", "value": 70}],
        }
    )
    unit = tmp_path / "unit.yml"
    unit.write_text(
        yaml.safe_dump(
            {
                "evaluation_interval": "15s",
                "tests": [
                    {
                        "interval": "15s",
                        "input_series": [{"series": k, "values": v} for k, v in series.items()],
                        "promql_expr_test": cases,
                    }
                ],
            },
            sort_keys=False,
        ),
        encoding="utf-8",
    )
    run = subprocess.run(
        ["promtool", "test", "rules", str(unit)], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr


# ---------------------------------------------------------------------------------------------
# Prometheus alerting rules

RULES = ROOT / "deploy" / "prometheus-rules.yml"
SEVERITIES = {"info", "warning", "critical"}


def _rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    assert set(data) == {"groups"}
    rules = []
    for group in data["groups"]:
        assert group["name"]
        assert group["rules"], group["name"]
        rules += group["rules"]
    return rules


def test_alert_rules_are_complete_and_on_metrics_the_worker_exports() -> None:
    rules = _rules()
    alerts = [r["alert"] for r in rules]
    assert len(alerts) == len(set(alerts))
    exported = _exported_names()
    used: set[str] = set()
    for rule in rules:
        name = rule["alert"]
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"(\d+[smh])+", rule["for"]), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        for key in ("summary", "description"):
            assert len(rule["annotations"][key]) > 20, (name, key)
        names = set(re.findall(r"\bredbatch_[a-z_]+", rule["expr"]))
        assert names, name
        assert names <= exported, (name, names - exported)
        used |= names
        # Several workers report the same Redis and streams: one alert per job (or per job and
        # shard), not per worker.
        assert re.match(r"(max|min) by \(job(, shard)?\) \(", rule["expr"]), name

    by_name = {r["alert"]: r for r in rules}
    low = by_name["RedbatchRedisMemoryHeadroomLow"]
    assert low["expr"].endswith("< 0.3")
    assert low["labels"]["severity"] == "warning"
    # Under 0.2 the producers' default high watermark (0.8 x maxmemory) refuses new work.
    critical = by_name["RedbatchRedisMemoryHeadroomCritical"]
    assert critical["expr"].endswith("< 0.2")
    assert critical["labels"]["severity"] == "critical"
    assert "RedisFull" in critical["annotations"]["description"]
    assert {
        "redbatch_redis_memory_headroom_ratio",
        "redbatch_redis_maxmemory_bytes",
        "redbatch_backlog_oldest_age_seconds",
        "redbatch_dead_letters",
    } <= used
    # Shards: the oldest request over all shards (one alert per job); dead letters per shard,
    # each shard having its own dead-letter stream.
    assert by_name["RedbatchBacklogOldestRequestOld"]["expr"].startswith("max by (job) (")
    dead = by_name["RedbatchDeadLettersGrowing"]
    assert dead["expr"].startswith("max by (job, shard) (")
    assert "$labels.shard" in dead["annotations"]["summary"]


# Two workers on one Redis (job w) whose headroom is under 0.2 by the least of them, requests
# that wait ever longer on one shard of two, a step in one shard's dead letters at 5 min (both
# workers report every shard, as they do); and a Redis with no maxmemory (job n, NaN headroom),
# which must trip neither headroom alert.
_SCENARIO = {
    'redbatch_redis_memory_headroom_ratio{job="w",instance="a"}': "0.25x300",
    'redbatch_redis_memory_headroom_ratio{job="w",instance="b"}': "0.15x300",
    'redbatch_redis_memory_headroom_ratio{job="n",instance="c"}': "NaN+0x300",
    'redbatch_redis_maxmemory_bytes{job="w",instance="a"}': "1e9+0x300",
    'redbatch_redis_maxmemory_bytes{job="n",instance="c"}': "0x300",
    'redbatch_backlog_oldest_age_seconds{job="w",instance="a",shard="demo"}': "0x300",
    'redbatch_backlog_oldest_age_seconds{job="w",instance="a",shard="demo~3"}': "0+15x300",
    'redbatch_dead_letters{job="w",instance="a",shard="demo"}': "0x20 2x280",
    'redbatch_dead_letters{job="w",instance="b",shard="demo"}': "0x20 2x280",
    'redbatch_dead_letters{job="w",instance="a",shard="demo~3"}': "5x300",
    'redbatch_dead_letters{job="w",instance="b",shard="demo~3"}': "5x300",
    # Job p: two pipeline workers whose 2 hook threads are 95% busy; a's model runs 15% of the
    # time (bound by preprocessing), b's 80% (the model is busy too). Job q: no pipeline.
    'redbatch_pipeline_busy_seconds_total{job="p",instance="a",stage="preprocess"}': "0+27x300",
    'redbatch_pipeline_busy_seconds_total{job="p",instance="a",stage="postprocess"}': "0+1.5x300",
    'redbatch_pipeline_threads{job="p",instance="a"}': "2x300",
    'redbatch_inference_seconds_sum{job="p",instance="a"}': "0+2.25x300",
    'redbatch_pipeline_busy_seconds_total{job="p",instance="b",stage="preprocess"}': "0+28.5x300",
    'redbatch_pipeline_threads{job="p",instance="b"}': "2x300",
    'redbatch_inference_seconds_sum{job="p",instance="b"}': "0+12x300",
    'redbatch_pipeline_busy_seconds_total{job="q",instance="c",stage="preprocess"}': "0x300",
    'redbatch_pipeline_threads{job="q",instance="c"}': "0x300",
    'redbatch_inference_seconds_sum{job="q",instance="c"}': "0+15x300",
}
_FIRING = {  # eval time: the (alertname, job) or (alertname, job, shard) firing then
    "1m": set(),
    "11m": {
        ("RedbatchRedisMemoryHeadroomLow", "w"),
        ("RedbatchRedisMemoryHeadroomCritical", "w"),
        ("RedbatchBacklogOldestRequestOld", "w"),
        ("RedbatchDeadLettersGrowing", "w", "demo"),  # not demo~3: its count did not change
    },  # job p's rates over 5m reach their figures ~5 min in: pending until after 11m
    # The dead letters stopped growing; the unlimited Redis has been so for an hour; job p's
    # worker a has been bound by preprocessing for over 10 min (b's model is busy too)
    "70m": {
        ("RedbatchRedisMemoryHeadroomLow", "w"),
        ("RedbatchRedisMemoryHeadroomCritical", "w"),
        ("RedbatchBacklogOldestRequestOld", "w"),
        ("RedbatchRedisMaxmemoryUnset", "n"),
        ("RedbatchBoundByPreprocessing", "p"),
    },
}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules_and_they_fire_when_they_should(tmp_path: Path) -> None:
    check = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr

    severity = {r["alert"]: r["labels"]["severity"] for r in _rules()}
    cases = [
        {
            "expr": 'ALERTS{alertstate="firing"}',
            "eval_time": at,
            "exp_samples": [
                {
                    "labels": f'ALERTS{{alertname="{key[0]}",alertstate="firing",job="{key[1]}",'
                    + "".join(f'shard="{shard}",' for shard in key[2:])
                    + f'severity="{severity[key[0]]}"}}',
                    "value": 1,
                }
                for key in sorted(firing)
            ],
        }
        for at, firing in _FIRING.items()
    ]
    unit = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": k, "values": v} for k, v in _SCENARIO.items()],
                "promql_expr_test": cases,
            }
        ],
    }
    path = tmp_path / "unit.yml"
    path.write_text(yaml.safe_dump(unit, sort_keys=False), encoding="utf-8")
    run = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
