"""The local Kafka broker: one JVM in KRaft mode (broker and controller together) on ``kafka_port`` and
``kafka_port + 1``. Writes its ``server.properties`` from ``infra/local/server.properties.template``,
formats its storage once and starts it in the background. A local cluster (``kafka_cluster.py``) runs one
of these per node, each given its :class:`Quorum` (node id, voters, replication), and, for a SASL_SSL
listener, the stack's :class:`BrokerSecurity` (certificates and SCRAM users, ``broker_security.py``).
"""

from __future__ import annotations

import base64
import string
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from cli.backbone.broker_security import BrokerSecurity, check_security, mark_formatted
from cli.backbone.jars import INFRA_DIR, infra_file, kafka_version
from cli.stack.layout import DevStackError, StackLayout
from cli.stack.processes import Owner, log, spawn
from sluicegate.settings import Settings

SERVER_TEMPLATE = INFRA_DIR / "server.properties.template"
LOG4J_CONFIG = INFRA_DIR / "log4j.properties"

KAFKA_START_TIMEOUT_S = 60.0
KAFKA_STOP_TIMEOUT_S = 30.0

# A small heap is plenty for a dev broker. C1-only JIT (TieredStopAtLevel=1) starts faster and keeps
# compiler threads off a 2-core machine's CPUs; peak throughput does not matter here. ``kafka_full_jit``
# drops it (latency benchmarks: once C2 has compiled the request path, a produce costs less broker time).
C1_ONLY = "-XX:TieredStopAtLevel=1"
KAFKA_JVM_OPTS: tuple[str, ...] = (
    "-Xms256m",
    "-Xmx512m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    C1_ONLY,
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)


@dataclass(frozen=True)
class Quorum:
    """What one node of a KRaft quorum needs to know: its id, every voter, and the replication that
    the cluster's size allows (default and internal topics)."""

    node_id: int
    voters: str
    replication: int
    min_isr: int
    cluster_id: str = ""  # every node of a cluster is formatted with the same id; "" = make one

    @classmethod
    def single(cls, layout: StackLayout) -> Quorum:
        return cls(1, f"1@127.0.0.1:{layout.kafka_port + 1}", 1, 1)


def kafka_jvm_opts(settings: Settings) -> list[str]:
    """The broker's JVM options: ``KAFKA_JVM_OPTS``, without the C1-only cap when ``kafka_full_jit``."""
    return [o for o in KAFKA_JVM_OPTS if not (settings.kafka_full_jit and o == C1_ONLY)]


def kafka_owner(layout: StackLayout) -> Owner:
    """Recognises this instance's broker by its main class and its own ``server.properties``."""
    props = str(layout.kafka_props)
    return lambda tokens: "kafka.Kafka" in tokens and props in tokens


def _write_config(
    layout: StackLayout, settings: Settings, quorum: Quorum, security: BrokerSecurity | None = None
) -> Path:
    template = string.Template(infra_file(SERVER_TEMPLATE).read_text())
    try:
        text = template.substitute(
            kafka_host=layout.kafka_host,
            kafka_port=layout.kafka_port,
            controller_port=layout.kafka_port + 1,
            log_dirs=layout.kafka_dir / "data",
            num_partitions=settings.topic_partitions,
            node_id=quorum.node_id,
            quorum_voters=quorum.voters,
            replication=quorum.replication,
            min_isr=quorum.min_isr,
            listener="SASL_SSL" if security is not None else "PLAINTEXT",
            security=(
                security.server_properties(deny_without_acl=settings.kafka_local_deny_without_acl)
                if security is not None
                else ""
            ),
        )
    except (KeyError, ValueError) as exc:
        raise DevStackError(f"{SERVER_TEMPLATE} has an unknown or malformed placeholder: {exc}") from exc
    layout.kafka_logs.mkdir(parents=True, exist_ok=True)
    layout.kafka_props.write_text(text)
    return layout.kafka_props


def _log_opts(layout: StackLayout) -> list[str]:
    return [f"-Dkafka.logs.dir={layout.kafka_logs}", f"-Dlog4j.configuration={infra_file(LOG4J_CONFIG).as_uri()}"]


def new_cluster_id() -> str:
    """A random cluster id in Kafka's ``Uuid`` text form (16 random bytes, URL-safe base64 without padding).

    Like Kafka's own ``Uuid.randomUuid``, never one that starts with "-": ``kafka-storage format -t -Xy...``
    takes it for an option and stops with "expected one argument" (1 id in 64; seen once in CI)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def _format_storage(
    layout: StackLayout, java: str, libs: Path, cluster_id: str = "", security: BrokerSecurity | None = None
) -> None:
    """Format the KRaft metadata log once (``meta.properties`` marks a formatted folder), with the SCRAM users
    of ``security``."""
    if (layout.kafka_dir / "data" / "meta.properties").exists():
        return
    id_file = layout.kafka_dir / "cluster.id"
    if cluster_id:
        id_file.write_text(cluster_id + "\n")
    cluster_id = id_file.read_text().strip() if id_file.exists() else ""
    if not cluster_id:
        cluster_id = new_cluster_id()
        id_file.write_text(cluster_id + "\n")
    cmd = [
        java,
        "-Xmx256m",
        "-XX:TieredStopAtLevel=1",
        *_log_opts(layout),
        "-cp",
        str(libs / "*"),
        "kafka.tools.StorageTool",
        "format",
        # One argument: an id that starts with "-" (made before new_cluster_id avoided them) is not an option.
        f"--cluster-id={cluster_id}",
        "-c",
        str(layout.kafka_props),
        "--ignore-formatted",
        *(security.scram_format_args() if security is not None else []),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        reason = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise DevStackError(f"formatting KRaft storage in {layout.kafka_dir / 'data'} failed: {reason}")
    mark_formatted(layout, security)
    log.info("devstack.kafka_formatted cluster_id=%s dir=%s", cluster_id, layout.kafka_dir / "data")


def start_kafka(
    layout: StackLayout,
    settings: Settings,
    java: str,
    libs: Path,
    quorum: Quorum | None = None,
    security: BrokerSecurity | None = None,
) -> int:
    """Write the config, format storage when new, and start the broker; returns its pid (not yet ready).
    ``quorum`` places it in a cluster; ``None`` is a one-node cluster of its own. ``security`` makes its client
    listener SASL_SSL."""
    quorum = quorum or Quorum.single(layout)
    check_security(layout, "sasl_ssl" if security is not None else "plaintext")
    _write_config(layout, settings, quorum, security)
    _format_storage(layout, java, libs, quorum.cluster_id, security)
    cmd = [
        java,
        *kafka_jvm_opts(settings),
        *_log_opts(layout),
        "-cp",
        str(libs / "*"),
        "kafka.Kafka",
        str(layout.kafka_props),
    ]
    pid = spawn(cmd, layout.kafka_out, layout.kafka_dir, layout.kafka_pid)
    log.info("devstack.kafka_spawned pid=%d bootstrap=%s version=%s", pid, layout.bootstrap, kafka_version())
    return pid
