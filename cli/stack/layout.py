"""Where a local stack's files live: one state folder, instances keyed by port, and the error type of the
dev-stack modules.

Layout of the state folder (``.sluicegate/`` by default, git-ignored)::

    kafka/libs/<version>/*.jar   broker jars, fetched once with Maven and shared by every instance
    kafka-<port>/                one broker: server.properties, cluster.id, data/, logs/, kafka.pid
    redis-<port>/                one Redis: data/, redis.log, redis.pid (with TLS: tls/, users.acl,
                                 acl-passwords.json)
    kv-disk/<worker>/            each ``up`` worker's own disk KV tier (``launcher.kv_disk_tier_env``)

Instances are keyed by port, so a test session on other ports shares the jar cache but never touches a
developer's running stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluicegate.settings import Settings


class DevStackError(RuntimeError):
    """A problem the user can fix (missing tool, busy port, broker that will not start); the message
    is one line meant to be printed as is."""


@dataclass(frozen=True)
class StackLayout:
    """The paths and addresses of one stack instance (a Kafka port and a Redis port under a state folder)."""

    state: Path
    kafka_port: int
    redis_port: int
    redis_tls: bool = False
    kafka_host: str = "127.0.0.1"  # the client listener's address (bound and advertised)

    @classmethod
    def of(cls, settings: Settings) -> StackLayout:
        ports = {
            "kafka_port": settings.kafka_port,
            "controller port (kafka_port + 1)": settings.kafka_port + 1,
            "redis_port": settings.redis_port,
        }
        for name, port in ports.items():
            if not 1 <= port <= 65535:
                raise DevStackError(f"{name} {port} is not a valid TCP port")
        if len(set(ports.values())) != len(ports):
            raise DevStackError(f"ports must differ: {ports}")
        state = settings.state_dir.expanduser().resolve()
        return cls(state, settings.kafka_port, settings.redis_port, settings.redis_tls, str(settings.kafka_host))

    @property
    def libs_root(self) -> Path:
        return self.state / "kafka" / "libs"

    @property
    def kafka_dir(self) -> Path:
        return self.state / f"kafka-{self.kafka_port}"

    @property
    def kafka_pid(self) -> Path:
        return self.kafka_dir / "kafka.pid"

    @property
    def kafka_props(self) -> Path:
        return self.kafka_dir / "server.properties"

    @property
    def kafka_logs(self) -> Path:
        return self.kafka_dir / "logs"

    @property
    def kafka_out(self) -> Path:
        return self.kafka_logs / "kafka.out"

    @property
    def redis_dir(self) -> Path:
        return self.state / f"redis-{self.redis_port}"

    @property
    def redis_pid(self) -> Path:
        return self.redis_dir / "redis.pid"

    @property
    def redis_tls_dir(self) -> Path:
        return self.redis_dir / "tls"

    @property
    def redis_acl_passwords(self) -> Path:
        return self.redis_dir / "acl-passwords.json"

    @property
    def redis_log(self) -> Path:
        return self.redis_dir / "redis.log"

    @property
    def bootstrap(self) -> str:
        return f"{self.kafka_host}:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        """The admin (``default`` user) URL; with TLS, checked against the stack's own CA."""
        if self.redis_tls:
            return f"rediss://127.0.0.1:{self.redis_port}/0?ssl_ca_certs={self.redis_tls_dir / 'ca.crt'}"
        return f"redis://127.0.0.1:{self.redis_port}/0"
