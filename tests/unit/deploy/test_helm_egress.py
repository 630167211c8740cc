"""The chart's egress NetworkPolicies: with networkPolicy.egress.enabled, each component may dial only DNS and the
peers it talks to (Kafka, Redis, the OTLP collector while tracing is on), a worker with a wheelModel its package
index too, and nothing else, not even the release's other pods.

Peers and ports are read back from the values (values-secure-transport.yaml and the chart's defaults), and each
policy is matched to the pods it selects by their labels, so a policy that selects no pod, or a pod no policy
restricts, fails.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import CHART, SECURE_VALUES, Manifests, by_kind, write_values

pytestmark = pytest.mark.slow

CHART_DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]["egress"]


def _egress_by_deployment(manifests: Manifests) -> dict[str, list[dict[str, Any]]]:
    """Each Deployment -> the egress rules of the one egress policy that selects its pods."""
    labels = {
        m["metadata"]["name"]: m["spec"]["template"]["metadata"]["labels"]
        for m in manifests
        if m["kind"] == "Deployment"
    }
    policies = [p for p in by_kind(manifests, "NetworkPolicy").values() if "Egress" in p["spec"]["policyTypes"]]
    found: dict[str, list[dict[str, Any]]] = {}
    for policy in policies:
        selector = policy["spec"]["podSelector"]["matchLabels"]
        selected = [name for name, pod in labels.items() if selector.items() <= pod.items()]
        assert len(selected) == 1, f"{policy['metadata']['name']} selects {selected}"
        assert selected[0] not in found, f"two egress policies select {selected[0]}"
        found[selected[0]] = policy["spec"]["egress"]
    assert set(found) == set(labels), f"pods no egress policy restricts: {set(labels) - set(found)}"
    return found


def _rule(peer: dict[str, Any]) -> dict[str, Any]:
    """The rule a peer's values give: its ports, and `to` only when it names peers."""
    return {"ports": peer["ports"], **({"to": peer["to"]} if peer["to"] else {})}


def _peers(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    egress = values.get("networkPolicy", {}).get("egress", {})
    return {
        name: {**CHART_DEFAULTS[name], **egress.get(name, {})}
        for name in ("dns", "kafka", "redis", "otlp", "packageIndex")
    }


def test_each_component_may_dial_only_its_peers(render: Callable[..., Manifests]) -> None:
    values = yaml.safe_load(SECURE_VALUES.read_text())
    peers = _peers(values)
    wheel = {m.get("key", m["name"]) for m in values["models"] if "wheelModel" in m}
    egress = _egress_by_deployment(render(SECURE_VALUES))
    assert len(egress) == 6  # ingress, router, result service, batch worker, and two models
    for name, rules in egress.items():
        expected = [_rule(peers[p]) for p in ("dns", "kafka", "redis", "otlp")]  # tracing is on in these values
        if any(name.endswith(f"-worker-{key}") for key in wheel):
            expected.append(_rule(peers["packageIndex"]))
        assert rules == expected, name


def test_without_tracing_no_component_may_reach_the_collector(render: Callable[..., Manifests], tmp_path: Path) -> None:
    egress = _egress_by_deployment(render(write_values(tmp_path, {"networkPolicy": {"egress": {"enabled": True}}})))
    otlp_ports = CHART_DEFAULTS["otlp"]["ports"]
    for name, rules in egress.items():
        assert all(rule["ports"] != otlp_ports for rule in rules), name
        assert len(rules) == (4 if "-worker-" in name else 3), name  # DNS, Kafka, Redis (+ the demo model's index)


def test_tracing_set_through_otel_variables_opens_the_collector(
    render: Callable[..., Manifests], tmp_path: Path
) -> None:
    otlp = {"to": [{"ipBlock": {"cidr": "10.9.0.0/24"}}], "ports": [{"port": 4317, "protocol": "TCP"}]}
    values = {
        "networkPolicy": {"egress": {"enabled": True, "otlp": otlp}},
        "router": {"env": {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://10.9.0.5:4317/v1/traces"}},
    }
    egress = _egress_by_deployment(render(write_values(tmp_path, values)))
    for name, rules in egress.items():
        assert (otlp in rules) == name.endswith("-router"), name  # only the process told to trace dials out


def test_egress_to_adds_rules_for_every_component(render: Callable[..., Manifests], tmp_path: Path) -> None:
    extra = {"to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}], "ports": [{"port": 8443, "protocol": "TCP"}]}
    egress = _egress_by_deployment(
        render(write_values(tmp_path, {"networkPolicy": {"egress": {"enabled": True, "to": [extra]}}}))
    )
    assert all(rules[-1] == extra for rules in egress.values())


def test_egress_off_renders_no_egress_policy(render: Callable[..., Manifests]) -> None:
    policies = by_kind(render(), "NetworkPolicy").values()
    assert policies and not [p for p in policies if "Egress" in p["spec"]["policyTypes"]]
