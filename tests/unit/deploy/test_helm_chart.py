"""The Helm chart: lint, render, validate every manifest, and check what the services and secrets hold.

Rendered for the default values (one CPU demo model) and for values-two-gpu-models.yaml. Core kinds are
validated strictly with kubernetes-validate; ScaledObject and ServiceMonitor (CRDs it has no schema for)
with crd_schemas.py, and the HPA behaviour a ScaledObject carries with Kubernetes' own HPA schema.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_support import (
    CHART,
    KUBE_VERSION,
    TWO_GPU_VALUES,
    Manifests,
    by_kind,
    env_of,
    parse_cli,
    pod_specs,
    run_helm,
    template_error,
    validate_manifest,
)

from sluicegate.settings import Settings

pytestmark = pytest.mark.slow

VALUE_SETS = {"default": None, "two-gpu": TWO_GPU_VALUES}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest, render: Callable[..., Manifests]) -> Manifests:
    return render(VALUE_SETS[request.param])


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_is_clean(helm: Path, name: str) -> None:
    args = ["lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION]
    if VALUE_SETS[name] is not None:
        args += ["-f", str(VALUE_SETS[name])]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_every_manifest_is_valid(rendered: Manifests) -> None:
    assert len(rendered) > 10
    for manifest in rendered:
        try:
            validate_manifest(manifest)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{manifest['kind']} {manifest['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_a_misspelt_field_is_caught_by_validation(rendered: Manifests) -> None:
    """The validation above can fail: a typo in a Deployment and in a ScaledObject is reported."""
    deployment = next(m for m in rendered if m["kind"] == "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(broken)
    scaled = next(m for m in rendered if m["kind"] == "ScaledObject")
    trigger = {
        **scaled["spec"]["triggers"][0],
        "metadata": {**scaled["spec"]["triggers"][0]["metadata"], "lagTreshold": "5"},
    }
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest({**scaled, "spec": {**scaled["spec"], "triggers": [trigger]}})


def test_every_component_and_object_kind_is_rendered(rendered: Manifests) -> None:
    deployments = by_kind(rendered, "Deployment")
    for component in ("ingress", "router", "result-service", "batch-worker"):
        assert f"sg-sluicegate-{component}" in deployments
    hpas = by_kind(rendered, "HorizontalPodAutoscaler")
    assert set(hpas) == {"sg-sluicegate-ingress", "sg-sluicegate-router", "sg-sluicegate-result-service"}
    for hpa in hpas.values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    pdb_targets = {
        tuple(sorted(p["spec"]["selector"]["matchLabels"].items()))
        for p in by_kind(rendered, "PodDisruptionBudget").values()
    }
    for deployment in deployments.values():  # every workload has a disruption budget
        assert tuple(sorted(deployment["spec"]["selector"]["matchLabels"].items())) in pdb_targets
    assert by_kind(rendered, "ServiceMonitor") and by_kind(rendered, "NetworkPolicy") and by_kind(rendered, "Secret")


def test_pods_run_unprivileged_and_every_command_is_a_real_subcommand(rendered: Manifests) -> None:
    for name, pod in pod_specs(rendered).items():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["automountServiceAccountToken"] is False, name
        for container in pod["containers"] + pod.get("initContainers", []):
            assert "command" not in container, f"{name}: the image's entrypoint is `sluicegate`"
            parse_cli(container["args"])  # batch-worker exists once the batch-jobs branch is merged
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True


def _env_names(rendered: Manifests) -> set[str]:
    names = set(by_kind(rendered, "ConfigMap")["sg-sluicegate-config"]["data"])
    for pod in pod_specs(rendered).values():
        for container in pod["containers"]:
            names |= {e["name"] for e in container.get("env", [])}
    return names


def test_every_variable_set_is_a_real_setting(rendered: Manifests) -> None:
    """A misspelt SLUICEGATE_* name would be ignored silently by pydantic-settings (extra="ignore").

    SLUICEGATE_WORKER_METRICS_PORT and SLUICEGATE_ROUTER_METRICS_PORT arrive with the observability branch.
    """
    known = {f"SLUICEGATE_{name.upper()}" for name in Settings.model_fields}
    assert _env_names(rendered) - known == set()


def test_services_select_pods_and_expose_metrics(rendered: Manifests) -> None:
    pod_labels = [m["spec"]["template"]["metadata"]["labels"] for m in rendered if m["kind"] == "Deployment"]
    monitor = next(iter(by_kind(rendered, "ServiceMonitor").values()))
    scraped = monitor["spec"]["selector"]["matchLabels"]
    for name, service in by_kind(rendered, "Service").items():
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), f"{name} selects no pod"
        assert scraped.items() <= service["metadata"]["labels"].items(), f"{name} is not scraped"
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    ingress = by_kind(rendered, "Deployment")["sg-sluicegate-ingress"]["spec"]["template"]["spec"]["containers"][0]
    assert ingress["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_secrets_reach_only_the_processes_that_need_them(rendered: Manifests) -> None:
    secret_name = "sg-sluicegate-secrets"
    assert set(by_kind(rendered, "Secret")[secret_name]["data"]) >= {
        "SLUICEGATE_REDIS_URL",
        "SLUICEGATE_STREAM_TOKEN_SECRET",
        "SLUICEGATE_API_KEYS",
    }
    for name, pod in pod_specs(rendered).items():
        env = env_of(pod["containers"][0])
        assert env["SLUICEGATE_REDIS_URL"] == {"secretKeyRef": {"name": secret_name, "key": "SLUICEGATE_REDIS_URL"}}
        assert ("SLUICEGATE_API_KEYS" in env) == name.endswith("-ingress"), name
        assert ("SLUICEGATE_STREAM_TOKEN_SECRET" in env) == name.endswith(("-ingress", "-result-service")), name
    assert "redis://" not in str(by_kind(rendered, "ConfigMap")), "the Redis URL (it may hold a password) is secret"


def test_given_keys_are_stored_and_missing_ones_generated(render: Callable[..., Manifests]) -> None:
    import base64

    given = by_kind(render(TWO_GPU_VALUES), "Secret")["sg-sluicegate-secrets"]["data"]
    assert base64.b64decode(given["SLUICEGATE_API_KEYS"]).decode() == "sg-test-key-aaaaaaaa,sg-test-key-bbbbbbbb"
    generated = by_kind(render(), "Secret")["sg-sluicegate-secrets"]["data"]
    assert base64.b64decode(generated["SLUICEGATE_API_KEYS"]).decode().startswith("sg-")
    assert len(base64.b64decode(generated["SLUICEGATE_STREAM_TOKEN_SECRET"])) >= 32


def test_an_existing_secret_replaces_the_charts_own(render: Callable[..., Manifests]) -> None:
    manifests = render(None, "--set", "secrets.existingSecret=ops-managed")
    assert by_kind(manifests, "Secret") == {}
    ingress = pod_specs(manifests)["sg-sluicegate-ingress"]["containers"][0]
    assert env_of(ingress)["SLUICEGATE_API_KEYS"]["secretKeyRef"]["name"] == "ops-managed"


def test_a_keys_file_is_mounted_into_ingress(render: Callable[..., Manifests], tmp_path: Path) -> None:
    values = tmp_path / "keys.yaml"
    values.write_text('secrets:\n  apiKeysFile: |\n    {"key": "sg-acme-0123456789", "tenant": "acme"}\n')
    pod = pod_specs(render(values))["sg-sluicegate-ingress"]
    container = pod["containers"][0]
    assert env_of(container)["SLUICEGATE_API_KEYS_FILE"] == "/etc/sluicegate/api-keys.jsonl"
    assert {"name": "api-keys", "mountPath": "/etc/sluicegate", "readOnly": True} in container["volumeMounts"]


def test_network_policies_open_only_the_public_ports(rendered: Manifests) -> None:
    policies = by_kind(rendered, "NetworkPolicy")
    assert policies["sg-sluicegate-ingress"]["spec"]["ingress"][0]["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert policies["sg-sluicegate-result-service"]["spec"]["ingress"][0]["ports"] == [
        {"port": 8001, "protocol": "TCP"}
    ]
    internal = policies["sg-sluicegate-metrics-only"]["spec"]
    components = next(
        e for e in internal["podSelector"]["matchExpressions"] if e["key"] == "app.kubernetes.io/component"
    )
    assert set(components["values"]) == {"worker", "router", "batch-worker"}
    assert internal["ingress"] == [
        {
            "ports": [{"port": "metrics", "protocol": "TCP"}],
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        }
    ]


def test_values_outside_the_schema_are_refused(helm: Path, tmp_path: Path) -> None:
    error = template_error(helm, "models:\n  - name: has/slash\n    path: /m\n", tmp_path)
    assert "/models/0" in error
    error = template_error(helm, "config:\n  not_a_setting: x\n", tmp_path)
    assert "'not_a_setting' does not match pattern '^(SLUICEGATE|OTEL)_" in error


def test_restricting_public_access_keeps_the_release_own_pods_in(
    render: Callable[..., Manifests], tmp_path: Path
) -> None:
    values = tmp_path / "np.yaml"
    lb = {"ipBlock": {"cidr": "10.0.0.0/16"}}
    values.write_text(yaml.safe_dump({"networkPolicy": {"publicFrom": [lb]}}))
    manifests = render(values)
    for manifest in manifests:
        validate_manifest(manifest)
    policies = by_kind(manifests, "NetworkPolicy")
    sources = policies["sg-sluicegate-ingress"]["spec"]["ingress"][0]["from"]
    assert sources == [lb, {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "sg"}}}]
