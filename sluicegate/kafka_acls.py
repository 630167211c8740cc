"""The Kafka ACLs of a deployment, from the names in :mod:`schemas.names`: what each service principal and each
tenant principal may do, as ``kafka-acls.sh`` commands or JSON (``sluicegate kafka acls``).

Each service gets what its code does on the broker: the router reads the inbound topics (and the usage ledger, for
the rollup it runs) and writes the model topics and DLQs, a model's workers read that model's topics and write
results, usage, DLQs and heartbeats, and so on. A tenant gets its own topics only with tenants apart
(``SLUICEGATE_TENANT_TOPICS``): it writes ``llm.inbound.<tenant>`` and ``llm.control.<tenant>`` and reads
``llm.results.<tenant>`` and ``llm.dlq.<tenant>``, with consumer groups named ``<tenant>.*``. With the shared topics
a tenant principal writes ``llm.inbound`` and reads ``llm.results``, which cannot keep tenants apart (said in the
output). No transactional ids are used. Topic creation (``Create`` on the cluster) is granted to the services that
create topics on first use.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

from schemas.names import Names, tenant_token

ResourceType = Literal["topic", "group", "cluster"]
PatternType = Literal["literal", "prefixed"]


@dataclass(frozen=True)
class Acl:
    """One allow rule: ``principal`` may do ``operation`` on a resource."""

    principal: str
    operation: Literal["Read", "Write", "Describe", "Create"]
    resource_type: ResourceType
    resource: str
    pattern_type: PatternType = "literal"

    def command(self, bootstrap: str) -> str:
        """The ``kafka-acls.sh`` line that adds it."""
        where = {"topic": f"--topic {shlex.quote(self.resource)}", "group": f"--group {shlex.quote(self.resource)}"}
        target = where.get(self.resource_type, "--cluster")
        pattern = " --resource-pattern-type prefixed" if self.pattern_type == "prefixed" else ""
        return (
            f"kafka-acls.sh --bootstrap-server {shlex.quote(bootstrap)} --add --allow-principal "
            f"{shlex.quote('User:' + self.principal)} --operation {self.operation} {target}{pattern}"
        )

    def as_json(self) -> dict[str, str]:
        return asdict(self)


def _topics(principal: str, operation: Literal["Read", "Write"], topics: Iterable[str]) -> list[Acl]:
    """``operation`` on each topic, with ``Describe`` (a client must see a topic's metadata to use it)."""
    rules = []
    for topic in dict.fromkeys(topics):
        rules += [Acl(principal, operation, "topic", topic), Acl(principal, "Describe", "topic", topic)]
    return rules


def _group(principal: str, group: str, pattern: PatternType = "literal") -> list[Acl]:
    return [Acl(principal, "Read", "group", group, pattern)]


def _create(principal: str) -> Acl:
    return Acl(principal, "Create", "cluster", "kafka-cluster")


def worker_principal(model: str) -> str:
    """The principal of the workers serving ``model``."""
    return f"worker-{model}"


def tenant_principal(tenant: str) -> str:
    """The principal a tenant's own clients authenticate as."""
    return f"tenant-{tenant_token(tenant)}"


def deployment_acls(
    names: Names,
    *,
    models: Iterable[str],
    tenants: Iterable[str],
    router_group: str,
    usage_group: str,
    usage_rollup: bool = True,
) -> list[Acl]:
    """Every ACL of the deployment: each service principal, a worker principal per model, a principal per tenant.
    ``usage_rollup`` (``SLUICEGATE_USAGE_ROLLUP``): the router process also runs the usage rollup, as the router."""
    models, tenants = list(dict.fromkeys(models)), list(dict.fromkeys(tenants))
    apart = names.tenants_apart
    model_topics = [topic for model in models for topic in names.request_topics(model)]
    inbound = [names.tenant_inbound_topic(t) for t in tenants] if apart else [names.inbound_topic]
    results = [names.results_topic, *(names.results_topic_of(t) for t in tenants)]
    dlqs = [names.dlq_topic, *(names.dlq_topic_of(t) for t in tenants)]
    controls = [names.control_topic, *(names.control_topic_of(t) for t in tenants)]
    rules = [
        # Ingress publishes requests, cancels and usage, and reads the workers' group lag for its backlog.
        *_topics("ingress", "Write", [*model_topics, names.control_topic, names.usage_topic]),
        # Ingress and the router follow the workers' KV events (no group) and ask for snapshots on llm.control.
        *_topics("ingress", "Read", [names.kv_events_topic]),
        *_topics("router", "Read", [names.kv_events_topic]),
        *_topics("router", "Write", [names.control_topic]),
        *(Acl("ingress", "Describe", "group", names.worker_group(model)) for model in models),
        _create("ingress"),
        # The router validates the inbound topics into the model topics, refusals into the DLQs.
        *_topics("router", "Read", inbound),
        *_group("router", f"{names.prefix}{router_group}"),
        *_topics("router", "Write", [*model_topics, *dlqs]),
        _create("router"),
        # The result service publishes the cancels of the streams it relays.
        *_topics("result-service", "Write", [names.control_topic]),
        _create("result-service"),
        # The batch service publishes its lines, cancels them, and collects their results (no group).
        *_topics("batch-service", "Write", [*model_topics, names.control_topic]),
        *_topics("batch-service", "Read", [names.results_topic]),
        _create("batch-service"),
    ]
    if usage_rollup:  # the rollup runs in the router process, as its principal, and reads the ledger in its group
        rules += [*_topics("router", "Read", [names.usage_topic]), *_group("router", f"{names.prefix}{usage_group}")]
    for model in models:
        worker = worker_principal(model)
        rules += [
            *_topics(worker, "Read", [*names.request_topics(model), *controls]),
            *_group(worker, names.worker_group(model)),
            *_topics(
                worker, "Write", [*results, names.usage_topic, *dlqs, names.heartbeats_topic, names.kv_events_topic]
            ),
            _create(worker),
        ]
    for tenant in tenants:
        principal = tenant_principal(tenant)
        rules += [
            *_topics(principal, "Write", [names.tenant_inbound_topic(tenant) if apart else names.inbound_topic]),
            *_topics(principal, "Read", [names.results_topic_of(tenant)]),
            # A tenant's own consumer groups are named after it (``<tenant>.`` and anything).
            *_group(principal, f"{tenant_token(tenant)}.", "prefixed"),
        ]
        if apart:  # its refusals and its cancels are its own only when the topics are
            rules += [
                *_topics(principal, "Read", [names.dlq_topic_of(tenant)]),
                *_topics(principal, "Write", [names.control_topic_of(tenant)]),
            ]
    return rules


def render(acls: list[Acl], bootstrap: str, *, apart: bool) -> str:
    """The ACLs as ``kafka-acls.sh`` lines, each principal's under a comment."""
    lines = []
    if not apart:
        lines.append(
            "# shared topics (SLUICEGATE_TENANT_TOPICS off): every tenant principal writes llm.inbound and reads "
            "llm.results, so tenants are not kept apart on the broker"
        )
    principal = None
    for acl in acls:
        if acl.principal != principal:
            principal = acl.principal
            lines.append(f"# User:{principal}")
        lines.append(acl.command(bootstrap))
    return "\n".join(lines)
