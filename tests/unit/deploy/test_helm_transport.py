"""The chart's secure transport: Kafka SASL/TLS, Redis TLS and Sentinel, OTLP TLS, as Secrets mounted as files.

Rendered with values-secure-transport.yaml (SASL_SSL with SCRAM, a private CA and a client certificate for Kafka;
rediss+sentinel:// with a CA and client certificate for Redis; an https collector with mutual TLS). What each
process is told is read back from the values file itself, so the test follows the file, and each variable's path
is followed to its mount, volume and Secret key: a path that names no mounted file fails.
"""

from __future__ import annotations

import base64
import posixpath
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import opentelemetry.sdk.environment_variables as otel_env
import pytest
import yaml
from deploy_support import (
    CHART,
    KUBE_VERSION,
    SECURE_VALUES,
    Manifests,
    by_kind,
    env_of,
    pod_specs,
    run_helm,
    template_error,
    validate_manifest,
    write_values,
)

from sluicegate.settings import Settings

pytestmark = pytest.mark.slow

COMPONENTS = ("ingress", "router", "result-service", "batch-worker")


@pytest.fixture(scope="module")
def secure(render: Callable[..., Manifests]) -> Manifests:
    return render(SECURE_VALUES)


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return yaml.safe_load(SECURE_VALUES.read_text())


def _workloads(manifests: Manifests) -> dict[str, dict[str, Any]]:
    """Every Deployment's pod spec; the secure values deploy each component and two models."""
    pods = pod_specs(manifests)
    assert {f"sg-sluicegate-{c}" for c in COMPONENTS} <= set(pods)
    assert sum("-worker-" in name for name in pods) == 2
    return pods


def _workloads_of_default(manifests: Manifests) -> dict[str, dict[str, Any]]:
    """The pod specs of the default values: each component and the one demo model."""
    pods = pod_specs(manifests)
    assert len(pods) == len(COMPONENTS) + 1
    return pods


def _files(pod: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Each variable whose value is a path in a Secret volume -> (Secret name, key), checking the mount on the way."""
    container = pod["containers"][0]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    found = {}
    for name, value in env_of(container).items():
        if not isinstance(value, str) or not value.startswith("/"):
            continue
        folder, file = posixpath.split(value)
        mount = mounts.get(folder)
        if mount is None or "secret" not in volumes[mount["name"]]:
            continue
        assert mount["readOnly"] is True, name
        secret = volumes[mount["name"]]["secret"]
        assert secret["defaultMode"] == 0o440, f"{name}: readable by the owner and the pod's fsGroup only"
        key = next((i["key"] for i in secret["items"] if i["path"] == file), None)
        assert key is not None, f"{name}={value}: no such file in volume {mount['name']}"
        found[name] = (secret["secretName"], key)
    return found


def _expected_files(values: dict[str, Any]) -> dict[str, tuple[str, str]]:
    kafka, redis, otlp = values["kafka"]["security"], values["redis"]["tls"], values["otlpTls"]
    return {
        "SLUICEGATE_KAFKA_SASL_PASSWORD_FILE": (kafka["passwordSecret"]["name"], kafka["passwordSecret"]["key"]),
        "SLUICEGATE_KAFKA_SSL_CAFILE": (kafka["caSecret"]["name"], kafka["caSecret"]["key"]),
        "SLUICEGATE_KAFKA_SSL_CERTFILE": (kafka["clientCertSecret"]["name"], kafka["clientCertSecret"]["certKey"]),
        "SLUICEGATE_KAFKA_SSL_KEYFILE": (kafka["clientCertSecret"]["name"], kafka["clientCertSecret"]["keyKey"]),
        "SLUICEGATE_REDIS_TLS_CA_FILE": (redis["caSecret"]["name"], redis["caSecret"]["key"]),
        "SLUICEGATE_REDIS_TLS_CERT_FILE": (redis["clientCertSecret"]["name"], redis["clientCertSecret"]["certKey"]),
        "SLUICEGATE_REDIS_TLS_KEY_FILE": (redis["clientCertSecret"]["name"], redis["clientCertSecret"]["keyKey"]),
        "OTEL_EXPORTER_OTLP_CERTIFICATE": (otlp["caSecret"]["name"], otlp["caSecret"]["key"]),
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": (
            otlp["clientCertSecret"]["name"],
            otlp["clientCertSecret"]["certKey"],
        ),
        "OTEL_EXPORTER_OTLP_CLIENT_KEY": (otlp["clientCertSecret"]["name"], otlp["clientCertSecret"]["keyKey"]),
    }


def test_the_secure_render_lints_and_every_manifest_is_valid(helm: Path, secure: Manifests) -> None:
    result = run_helm(helm, "lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION, "-f", str(SECURE_VALUES))
    assert result.returncode == 0, result.stdout + result.stderr
    for manifest in secure:
        validate_manifest(manifest)


def test_every_process_reads_each_credential_from_a_mounted_secret_file(
    secure: Manifests, values: dict[str, Any]
) -> None:
    expected = _expected_files(values)
    for name, pod in _workloads(secure).items():
        assert _files(pod) == expected, name
        secret_volumes = {v["name"] for v in pod["volumes"] if "secret" in v}
        mounted = {m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert secret_volumes <= mounted, f"{name}: a Secret volume no container mounts"
        for init in pod.get("initContainers", []):  # the model fetch talks to neither Kafka nor Redis
            assert not {m["name"] for m in init["volumeMounts"]} & secret_volumes, f"{name}: {init['name']}"


def test_every_process_gets_the_kafka_security_settings(secure: Manifests, values: dict[str, Any]) -> None:
    security = values["kafka"]["security"]
    for name, pod in _workloads(secure).items():
        env = env_of(pod["containers"][0])
        assert env["SLUICEGATE_KAFKA_SECURITY_PROTOCOL"] == security["protocol"], name
        assert env["SLUICEGATE_KAFKA_SASL_MECHANISM"] == security["saslMechanism"], name
        assert env["SLUICEGATE_KAFKA_SASL_USERNAME"] == security["username"], name
        assert env["SLUICEGATE_KAFKA_SSL_CHECK_HOSTNAME"] == str(security["checkHostname"]).lower(), name
    for scaled in by_kind(secure, "ScaledObject").values():
        for trigger in (t for t in scaled["spec"]["triggers"] if t["type"] == "kafka"):
            assert trigger["authenticationRef"] == {"name": values["keda"]["kafkaAuthenticationRef"]}


def test_the_default_install_carries_no_transport_settings(render: Callable[..., Manifests]) -> None:
    for name, pod in pod_specs(render()).items():
        names = set(env_of(pod["containers"][0]))
        assert not {n for n in names if n.startswith(("SLUICEGATE_KAFKA_S", "SLUICEGATE_REDIS_TLS_", "OTEL_"))}, name
        assert not [v for v in pod["volumes"] if "secret" in v], name


def test_an_oauth_token_over_sasl_plaintext_mounts_the_token_and_no_tls_files(
    render: Callable[..., Manifests], tmp_path: Path
) -> None:
    token = {"name": "kafka-token", "key": "jwt"}
    security = {"protocol": "SASL_PLAINTEXT", "saslMechanism": "OAUTHBEARER", "oauthTokenSecret": token}
    manifests = render(
        write_values(tmp_path, {"kafka": {"security": security}, "keda": {"kafkaAuthenticationRef": "k"}})
    )
    for name, pod in _workloads_of_default(manifests).items():
        env = env_of(pod["containers"][0])
        assert _files(pod) == {"SLUICEGATE_KAFKA_SASL_OAUTH_TOKEN_FILE": ("kafka-token", "jwt")}, name
        assert env["SLUICEGATE_KAFKA_SASL_MECHANISM"] == "OAUTHBEARER"
        assert "SLUICEGATE_KAFKA_SSL_CHECK_HOSTNAME" not in env and "SLUICEGATE_KAFKA_SASL_USERNAME" not in env


def test_every_transport_variable_is_a_real_setting(secure: Manifests) -> None:
    """A SLUICEGATE_* name the settings do not have is ignored silently (extra="ignore"): the chart's names must
    be the settings' own."""
    known = {f"SLUICEGATE_{name.upper()}" for name in Settings.model_fields}
    for name, pod in pod_specs(secure).items():
        ours = {n for n in env_of(pod["containers"][0]) if n.startswith("SLUICEGATE_")}
        assert ours - known == set(), name


def test_every_otel_variable_is_one_opentelemetry_reads(secure: Manifests) -> None:
    known = {value for key, value in vars(otel_env).items() if key.startswith("OTEL_") and isinstance(value, str)}
    config = set(by_kind(secure, "ConfigMap")["sg-sluicegate-config"]["data"])
    for name, pod in pod_specs(secure).items():
        ours = {n for n in set(env_of(pod["containers"][0])) | config if n.startswith("OTEL_")}
        assert ours and ours - known == set(), name


@pytest.mark.parametrize(
    "url",
    [
        "rediss://sluicegate:pw@redis.example.com:6380/0",
        "redis+sentinel://:pw@sentinel-0.redis.svc:26379,sentinel-1.redis.svc:26379/mymaster/0",
        "rediss+sentinel://:pw@sentinel-0.redis.svc:26379/mymaster",
    ],
)
def test_tls_and_sentinel_redis_urls_are_accepted(render: Callable[..., Manifests], tmp_path: Path, url: str) -> None:
    secret = by_kind(render(write_values(tmp_path, {"redis": {"url": url}})), "Secret")["sg-sluicegate-secrets"]
    assert base64.b64decode(secret["data"]["SLUICEGATE_REDIS_URL"]).decode() == url


_KEDA = {"keda": {"kafkaAuthenticationRef": "kafka-keda"}}
_CA = {"name": "kafka-ca", "key": "ca.crt"}


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"kafka": {"security": {"protocol": "TLS"}}}, "value must be one of 'PLAINTEXT', 'SSL'"),
        ({"kafka": {"security": {"protocol": "SASL_SSL"}}, **_KEDA}, "missing property 'saslMechanism'"),
        (
            {"kafka": {"security": {"protocol": "SASL_SSL", "saslMechanism": "SCRAM-SHA-1"}}, **_KEDA},
            "/kafka/security/saslMechanism': value must be one of",
        ),
        (
            {"kafka": {"security": {"protocol": "SASL_SSL", "saslMechanism": "SCRAM-SHA-256", "username": "u"}}},
            "missing property 'passwordSecret'",
        ),
        (
            {"kafka": {"security": {"protocol": "SASL_SSL", "saslMechanism": "OAUTHBEARER"}}, **_KEDA},
            "missing property 'oauthTokenSecret'",
        ),
        ({"kafka": {"security": {"protocol": "SSL", "caSecret": {"name": "ca"}}}}, "caSecret': missing property 'key'"),
        (
            {"redis": {"tls": {"clientCertSecret": {"name": "c", "certKey": "tls.crt"}}}},
            "clientCertSecret': missing property 'keyKey'",
        ),
        ({"otlpTls": {"caSecret": {"name": "Not_A_Name", "key": "ca.crt"}}}, "/otlpTls/caSecret/name"),
        ({"kafka": {"security": {"caSecret": _CA}}}, "protocol PLAINTEXT does not use TLS"),
        (
            {"kafka": {"security": {"protocol": "SSL", "saslMechanism": "PLAIN"}}, **_KEDA},
            "protocol SSL does not use SASL",
        ),
        ({"kafka": {"security": {"protocol": "SSL", "caSecret": _CA}}}, "keda.kafkaAuthenticationRef is empty"),
        ({"redis": {"tls": {"caSecret": {"name": "redis-ca", "key": "ca.crt"}}}}, "redis.url is not rediss://"),
        (
            {"otlpEndpoint": "http://collector:4318", "otlpTls": {"caSecret": {"name": "ca", "key": "ca.crt"}}},
            "otlpEndpoint is http://",
        ),
        ({"redis": {"url": "sentinel://s:26379/m"}}, "/redis/url"),
        ({"networkPolicy": {"egress": {"kafka": {"to": [], "ports": []}}}}, "/networkPolicy/egress/kafka/ports"),
    ],
)
def test_inconsistent_transport_values_are_refused(
    helm: Path, tmp_path: Path, values: dict[str, Any], error: str
) -> None:
    assert error in template_error(helm, yaml.safe_dump(values), tmp_path)


def test_otel_variables_are_accepted_in_config_and_component_env(
    render: Callable[..., Manifests], tmp_path: Path
) -> None:
    values = {
        "config": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio"},
        "router": {"env": {"OTEL_BSP_SCHEDULE_DELAY": 500}},
    }
    manifests = render(write_values(tmp_path, values))
    assert (
        by_kind(manifests, "ConfigMap")["sg-sluicegate-config"]["data"]["OTEL_TRACES_SAMPLER"]
        == "parentbased_traceidratio"
    )
    assert env_of(pod_specs(manifests)["sg-sluicegate-router"]["containers"][0])["OTEL_BSP_SCHEDULE_DELAY"] == "500"


def test_the_managed_kafka_examples_of_the_deploy_guide_render(
    render: Callable[..., Manifests], tmp_path: Path
) -> None:
    """docs/deploy.md's MSK, Confluent Cloud and Strimzi values (before any `---`) are values the chart takes."""
    guide = (CHART.parents[2] / "docs" / "deploy.md").read_text()
    section = guide[guide.index("## Managed Kafka with TLS and SASL in the chart") :]
    section = section[: section.index("\n## ", 1)]
    examples = [block.split("\n---\n")[0] for block in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    assert len(examples) == 3
    for example in examples:
        values = yaml.safe_load(example)
        manifests = render(write_values(tmp_path, values))
        router = env_of(pod_specs(manifests)["sg-sluicegate-router"]["containers"][0])
        assert router["SLUICEGATE_KAFKA_SECURITY_PROTOCOL"] == values["kafka"]["security"]["protocol"]
