"""``sluicegate kafka acls``: every topic and group schemas/names.py names is covered, each tenant reaches only
its own topics with tenants apart, and the commands are kafka-acls.sh lines."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from schemas import TIERS, Names
from sluicegate.kafka_acls import Acl, deployment_acls, tenant_principal, worker_principal

ROOT = Path(__file__).resolve().parents[2]
MODELS, TENANTS = ["tiny", "org/big"], ["acme", "beta:x"]


def _acls(names: Names) -> list[Acl]:
    return deployment_acls(names, models=MODELS, tenants=TENANTS, router_group="rg", usage_group="ug")


def _every_topic(names: Names) -> set[str]:
    """Every topic name a ``Names`` member gives, for each model, tier and tenant: a new topic member is met here."""
    found: set[str] = set()
    for attr, member in inspect.getmembers(type(names)):
        if "topic" not in attr or attr.startswith("_"):
            continue
        if isinstance(member, property):
            found.add(getattr(names, attr))
            continue
        params = list(inspect.signature(member).parameters)[1:]
        choices = {"model": MODELS, "tier": list(TIERS), "tenant": TENANTS}
        assert set(params) <= set(choices), f"Names.{attr} takes {params}: teach this test its arguments"
        combos: list[dict[str, str]] = [{}]
        for param in params:
            combos = [combo | {param: value} for combo in combos for value in choices[param]]
        for combo in combos:
            value = getattr(names, attr)(**combo)
            found.update(value if isinstance(value, list) else [value])
    return found


def test_every_topic_names_defines_has_acls_in_both_modes() -> None:
    for names in (Names("p."), Names("p.", tenants_apart=True)):
        acls = _acls(names)
        covered = {acl.resource for acl in acls if acl.resource_type == "topic"}
        missing = _every_topic(names) - covered
        if names.tenants_apart:  # nobody reads the shared inbound topic then: the router reads the tenants'
            missing -= {names.inbound_topic}
        else:  # and the tenants' inbound topics exist only with tenants apart
            missing -= {names.tenant_inbound_topic(t) for t in TENANTS}
        assert not missing, f"topics without ACLs: {sorted(missing)}"
        groups = {acl.resource for acl in acls if acl.resource_type == "group"}
        assert {names.worker_group(m) for m in MODELS} | {"p.rg", "p.ug"} <= groups


def test_a_tenant_reaches_only_its_own_topics_when_apart() -> None:
    names = Names("p.", tenants_apart=True)
    acls = _acls(names)
    for tenant in TENANTS:
        principal = tenant_principal(tenant)
        topics = {a.resource for a in acls if a.principal == principal and a.resource_type == "topic"}
        expected = {
            names.tenant_inbound_topic(tenant),
            names.results_topic_of(tenant),
            names.dlq_topic_of(tenant),
            names.control_topic_of(tenant),
        }
        assert expected <= topics
        others = [t for t in TENANTS if t != tenant]
        for other in others:
            assert names.results_topic_of(other) not in topics and names.dlq_topic_of(other) not in topics
        assert names.results_topic not in topics and names.inbound_topic not in topics
    # The router reads each tenant's inbound topic and not the shared one.
    router_reads = {a.resource for a in acls if a.principal == "router" and a.operation == "Read"}
    assert names.inbound_topic not in router_reads
    assert {names.tenant_inbound_topic(t) for t in TENANTS} <= router_reads
    worker_reads = {a.resource for a in acls if a.principal == worker_principal("tiny") and a.operation == "Read"}
    assert {names.control_topic_of(t) for t in TENANTS} <= worker_reads
    assert names.request_topic("org/big", "batch") not in worker_reads  # a model's workers read only its topics


@pytest.mark.slow  # two interpreters started
def test_the_command_prints_kafka_acls_lines_and_json() -> None:
    env = {"SLUICEGATE_TENANT_TOPICS": "true", "SLUICEGATE_TENANTS": "acme", "PATH": "/usr/bin:/bin"}
    run = [sys.executable, "-m", "cli", "kafka", "acls", "--model", "tiny", "--bootstrap-server", "k:9093"]
    text = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    line = (
        "kafka-acls.sh --bootstrap-server k:9093 --add --allow-principal User:tenant-acme --operation Write "
        "--topic llm.inbound.acme"
    )
    assert line in text.splitlines()
    assert "--group acme. --resource-pattern-type prefixed" in text
    shared = subprocess.run([*run, "--shared-topics", "--json"], cwd=ROOT, env=env, capture_output=True, text=True)
    rules = json.loads(shared.stdout)
    assert {
        "principal": "tenant-acme",
        "operation": "Write",
        "resource_type": "topic",
        "resource": "llm.inbound",
        "pattern_type": "literal",
    } in rules


def test_the_router_reads_the_usage_ledger_for_the_rollup_it_runs() -> None:
    names = Names("p.", tenants_apart=True)
    rollup = {
        ("Read", "topic", names.usage_topic),
        ("Describe", "topic", names.usage_topic),
        ("Read", "group", "p.ug"),
    }
    router = {(a.operation, a.resource_type, a.resource) for a in _acls(names) if a.principal == "router"}
    assert rollup <= router
    without = deployment_acls(
        names, models=MODELS, tenants=TENANTS, router_group="rg", usage_group="ug", usage_rollup=False
    )
    assert not [a for a in without if a.resource in (names.usage_topic, "p.ug") and a.operation == "Read"]
    assert {a.principal for a in _acls(names)} == {a.principal for a in without}  # no principal of the rollup's own
