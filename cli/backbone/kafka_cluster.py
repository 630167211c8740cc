"""A local multi-broker Kafka (``sluicegate dev up --brokers 3``): N KRaft nodes, each broker and controller,
forming one controller quorum of N voters.

Ports derive from ``kafka_port``: node ``i`` (0-based) listens on ``kafka_port + 2i`` (clients) and
``kafka_port + 2i + 1`` (controller). Each node is an ordinary broker instance of ``kafka_broker.py`` with
its own folder ``kafka-<port>/`` (so its pid file, data and logs are where a single broker's would be);
node 0's folder also records the cluster size in ``cluster.nodes``, which ``down`` and a later ``up``
read. With 3 or more nodes the default and internal topics get 3 replicas and ``min.insync.replicas`` 2.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from cli.backbone.broker_security import BrokerSecurity, LocalSecurity
from cli.backbone.kafka_broker import Quorum, kafka_owner, new_cluster_id, start_kafka
from cli.stack.layout import DevStackError, StackLayout
from cli.stack.processes import running_pid
from sluicegate.kafka import probe_kafka
from sluicegate.settings import KafkaSecuritySettings, Settings

MAX_BROKERS = 5


def replication_for(brokers: int) -> tuple[int, int]:
    """(replication, min.insync.replicas) a cluster of ``brokers`` nodes allows: 3 and 2 from 3 nodes up,
    so one broker may fail with every write still acknowledged by two."""
    replication = min(3, brokers)
    return replication, 2 if replication >= 3 else 1


def node_layouts(layout: StackLayout, brokers: int) -> list[StackLayout]:
    """One layout per node; node 0 is ``layout`` itself."""
    if not 1 <= brokers <= MAX_BROKERS:
        raise DevStackError(f"--brokers {brokers}: expected 1..{MAX_BROKERS}")
    nodes = [
        StackLayout(layout.state, layout.kafka_port + 2 * i, layout.redis_port, kafka_host=layout.kafka_host)
        for i in range(brokers)
    ]
    for node in nodes:
        if layout.redis_port in (node.kafka_port, node.kafka_port + 1) or node.kafka_port + 1 > 65535:
            raise DevStackError(f"Kafka node port {node.kafka_port} collides with Redis or is out of range")
    return nodes


def cluster_bootstrap(nodes: list[StackLayout]) -> str:
    return ",".join(node.bootstrap for node in nodes)


def _size_file(layout: StackLayout) -> Path:
    return layout.kafka_dir / "cluster.nodes"


def recorded_size(layout: StackLayout) -> int:
    """The cluster size node 0's folder was formatted for (1 when nothing says otherwise)."""
    path = _size_file(layout)
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 1


def check_size(layout: StackLayout, brokers: int) -> None:
    """A folder formatted for one cluster size cannot join another quorum: say so instead of a JVM error."""
    formatted = (layout.kafka_dir / "data" / "meta.properties").exists()
    if formatted and recorded_size(layout) != brokers:
        raise DevStackError(
            f"the Kafka data in {layout.kafka_dir} belongs to a {recorded_size(layout)}-broker stack, not "
            f"{brokers}: run `sluicegate dev down` and remove the kafka-* folders under {layout.state}, or use "
            "another SLUICEGATE_KAFKA_PORT"
        )


def running_pids(nodes: list[StackLayout]) -> list[int | None]:
    return [running_pid(node.kafka_pid, kafka_owner(node)) for node in nodes]


def stack_security(nodes: list[StackLayout], mode: LocalSecurity) -> BrokerSecurity | None:
    """The SASL_SSL material of a stack (made when missing, in node 0's folder), or None for plaintext."""
    if mode == "plaintext":
        return None
    return BrokerSecurity.of(nodes[0]).ensure(cluster_bootstrap(nodes))


def start_nodes(
    nodes: list[StackLayout], settings: Settings, java: str, libs: Path, which: list[int]
) -> dict[int, int]:
    """Start nodes ``which`` (indexes into ``nodes``) of the cluster; returns {index: pid}."""
    brokers = len(nodes)
    replication, min_isr = replication_for(brokers)
    voters = ",".join(f"{i + 1}@127.0.0.1:{node.kafka_port + 1}" for i, node in enumerate(nodes))
    id_file = nodes[0].kafka_dir / "cluster.id"
    cluster_id = id_file.read_text().strip() if id_file.exists() else ""
    if not cluster_id:
        cluster_id = new_cluster_id()
    nodes[0].kafka_dir.mkdir(parents=True, exist_ok=True)
    _size_file(nodes[0]).write_text(f"{brokers}\n")
    security = stack_security(nodes, settings.kafka_local_security)
    pids = {}
    for index in which:
        quorum = Quorum(index + 1, voters, replication, min_isr, cluster_id)
        pids[index] = start_kafka(nodes[index], settings, java, libs, quorum, security)
    return pids


async def wait_for_brokers(
    bootstrap: str,
    brokers: int,
    timeout_s: float,
    check: Callable[[], None] | None = None,
    security: KafkaSecuritySettings | None = None,
) -> dict[str, object]:
    """Until the cluster's metadata lists ``brokers`` brokers (a quorum alone is not enough: topics with
    3 replicas cannot be created before 3 brokers registered)."""
    deadline = time.monotonic() + timeout_s
    last: object = "no answer"
    while True:
        try:
            cluster = await probe_kafka(
                bootstrap, timeout_s=max(0.5, min(5.0, deadline - time.monotonic())), settings=security
            )
            if len(cluster.get("brokers", [])) >= brokers:
                return cluster
            last = f"{len(cluster.get('brokers', []))} of {brokers} brokers registered"
        except ConnectionError as exc:
            last = exc
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"Kafka cluster at {bootstrap} not ready after {timeout_s:.0f}s: {last}")
        await asyncio.sleep(0.3)
