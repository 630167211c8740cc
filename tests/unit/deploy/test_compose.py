"""infra/compose/docker-compose.yml: Kafka in KRaft mode, Redis, every service with the settings
`sluicegate up` gives its children, and each command checked against the real CLI parser."""

from __future__ import annotations

import ast
import re
from typing import Any

import pytest
import yaml
from deploy_support import REPO_ROOT, parse_cli

from sluicegate.settings import Settings

COMPOSE = REPO_ROOT / "infra" / "compose" / "docker-compose.yml"
OUR_SERVICES = ["router", "ingress", "result-service", "worker", "batch-worker"]


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _ours(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if s["image"].split(":")[0] in ("sluicegate", "sluicegate-worker")}


def _launcher_env_names() -> set[str]:
    """The SLUICEGATE_* variables `sluicegate up` sets for its children, read from launcher.py itself."""
    tree = ast.parse((REPO_ROOT / "cli" / "stack" / "launcher.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            names |= {
                k.value for k in node.keys if isinstance(k, ast.Constant) and str(k.value).startswith("SLUICEGATE_")
            }
    assert names, "launcher.py no longer builds its children's environment in a dict literal"
    return names


def test_every_part_of_the_pipeline_is_a_service(services: dict[str, dict[str, Any]]) -> None:
    assert {"kafka", "redis", *OUR_SERVICES} <= set(services)


def test_kafka_is_the_official_image_in_kraft_mode(services: dict[str, dict[str, Any]]) -> None:
    kafka = services["kafka"]
    assert re.fullmatch(r"apache/kafka:\d+\.\d+\.\d+", kafka["image"])
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@kafka:9093"
    assert "zookeeper" not in COMPOSE.read_text().lower()
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]


def test_every_command_parses_with_the_cli(services: dict[str, dict[str, Any]]) -> None:
    """batch-worker exists once the batch-jobs branch is merged."""
    ours = _ours(services)
    assert set(OUR_SERVICES) <= set(ours)
    for name, service in ours.items():
        args = parse_cli(service["command"])
        if name in OUR_SERVICES:
            assert args.command == name


def test_services_get_the_settings_of_sluicegate_up(services: dict[str, dict[str, Any]]) -> None:
    wanted = _launcher_env_names()
    known = {f"SLUICEGATE_{field.upper()}" for field in Settings.model_fields}
    for name in OUR_SERVICES:
        env = services[name]["environment"]
        assert wanted <= set(env), f"{name} lacks {wanted - set(env)}"
        assert set(env) <= known, f"{name}: unknown settings {set(env) - known}"
        assert env["SLUICEGATE_KAFKA_BOOTSTRAP"] == "kafka:9092"
        assert env["SLUICEGATE_REDIS_URL"] == "redis://redis:6379/0"
        # Secrets come from the caller's environment, never from the file.
        assert env["SLUICEGATE_API_KEYS"].startswith("${SLUICEGATE_API_KEYS:?")
        assert env["SLUICEGATE_STREAM_TOKEN_SECRET"].startswith("${SLUICEGATE_STREAM_TOKEN_SECRET:?")


def test_the_worker_serves_the_model_built_at_start(services: dict[str, dict[str, Any]]) -> None:
    made = parse_cli(services["model-init"]["command"])
    worker = services["worker"]
    assert worker["environment"]["SLUICEGATE_MODEL"] == made.out
    assert worker["depends_on"]["model-init"] == {"condition": "service_completed_successfully"}
    shared = {v.split(":")[0] for v in services["model-init"]["volumes"]} & {v.split(":")[0] for v in worker["volumes"]}
    assert shared, "the worker does not mount the volume the model is built into"


def test_healthchecks_probe_the_ports_the_services_listen_on(services: dict[str, dict[str, Any]]) -> None:
    settings = Settings()
    # 8002 and 8003: SLUICEGATE_WORKER_METRICS_PORT and SLUICEGATE_ROUTER_METRICS_PORT (observability branch).
    expected = {
        "ingress": f"{settings.ingress_port}/readyz",
        "result-service": f"{settings.result_port}/healthz",
        "worker": "8002/readyz",
        "router": "8003/metrics",
    }
    for name, url_tail in expected.items():
        assert url_tail in " ".join(services[name]["healthcheck"]["test"]), name
    assert "kafka-broker-api-versions.sh" in " ".join(services["kafka"]["healthcheck"]["test"])
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on a missing service {dependency}"
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits on {dependency}, which has no healthcheck"


def test_a_stopping_worker_has_time_to_drain(services: dict[str, dict[str, Any]]) -> None:
    grace = int(services["worker"]["stop_grace_period"].rstrip("s"))
    assert grace > Settings().drain_timeout_s
