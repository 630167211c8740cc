"""The Redis ACL user of each service: only the commands and the key patterns (under the topic prefix) its code
issues, as data, and the ``ACL SETUSER`` lines (or ACL-file lines) that create them.

Each :class:`Feature` is one part of the pipeline's use of Redis (reading request streams, the batch store, the
Celery broker...) with the commands it sends and the keys it touches (as :class:`schemas.Names` spells them);
a service's user holds the union of its features. Lua scripts (``register_script``: ``EVALSHA``, with ``SCRIPT
LOAD``/``SCRIPT EXISTS`` to load them) run their ``redis.call`` commands as the calling user, so a feature that
runs a script also lists the commands inside it. ``tests/integration/test_redis_security.py`` loads these users
into a real redis-server and runs each service's operations under its own user, so a missing permission fails
there, not in production.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict

#: What every client sends on connecting (redis-py: HELLO, CLIENT SETNAME, SELECT for a db other than 0)
#: plus the start-up check's PING and EXISTS (:mod:`sluicegate.redis_access`).
_CONNECTION = ("hello", "auth", "client|setname", "select", "ping", "exists")
_SCRIPTS = ("evalsha", "script|load", "script|exists")


class Feature(BaseModel):
    """One use of Redis: the commands it sends, the key patterns (relative to the topic prefix) and the Pub/Sub
    channel patterns it touches."""

    model_config = ConfigDict(frozen=True)

    commands: tuple[str, ...]
    keys: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()


FEATURES: dict[str, Feature] = {
    # sluicegate/stream_follower.py (ingress's SSE, the result service, the batch outcomes): blocking XREAD on a
    # client it unblocks by id, replays with XRANGE/XREVRANGE.
    "stream_read": Feature(
        commands=("xread", "xrange", "xrevrange", "client|id", "client|unblock"), keys=("llm:stream:*",)
    ),
    # gpu_workers/worker/streams.py: pipelined idempotent XADDs with the TTL, resume reads; ROLE and WAIT when a
    # write must reach a replica (Sentinel); router/refusal_events.py and ingress's cached replies append too.
    "stream_write": Feature(
        commands=("xadd", "xrange", "expire", "multi", "exec", "role", "wait", *_SCRIPTS), keys=("llm:stream:*",)
    ),
    # gpu_workers/worker/fencing.py: the owner epoch raised at pick-up (INCR, which redis-py sends as INCRBY, and
    # EXPIRE) and checked, raised or kept alive by the fenced-write script (GET, SET, EXPIRE run as the calling user).
    "ownership": Feature(commands=("incr", "incrby", "get", "set", "expire", *_SCRIPTS), keys=("llm:epoch:*",)),
    # The request's status record and cancel marker (ingress/service.py, sluicegate/cancellation.py, the worker).
    "request_state": Feature(
        commands=("get", "set", "del", "expire"), keys=("llm:request:*", "llm:cancel:*", "llm:reader:*")
    ),
    # gpu_workers/worker/heartbeat.py and the tokenizer the workers publish.
    "heartbeat_write": Feature(
        commands=("hset", "hdel", "sadd", "set", "expire", "multi", "exec"),
        keys=("llm:workers:*", "llm:models", "llm:tokenizer:*"),
    ),
    # router/heartbeats.py, sluicegate/api/prompt_tokens.py: who serves what, and how prompts count.
    "heartbeat_read": Feature(
        commands=("hgetall", "smembers", "get"), keys=("llm:workers:*", "llm:models", "llm:tokenizer:*")
    ),
    # ingress/ratelimit.py (GCRA script: GET, SET, TIME), ingress/response_cache.py, router/rollbacks.py.
    "ingress_limits": Feature(
        commands=("get", "set", "del", "mget", "expire", "xadd", "time", *_SCRIPTS),
        keys=("llm:rate:*", "llm:reply-cache:*", "llm:route-rollback:*"),
    ),
    "route_rollbacks": Feature(commands=("get", "mget", "set"), keys=("llm:route-rollback:*",)),
    # sluicegate/lora/registry.py and checks.py: the adapter registry and the check queue between ingress and
    # a worker (the asker RPUSHes a check and BLPOPs the verdict; the worker BLPOPs checks and RPUSHes verdicts).
    "lora": Feature(
        commands=("hgetall", "hget", "hexists", "hsetnx", "hdel", "incr", "rpush", "blpop", "lrem", "expire"),
        keys=("lora:*",),
    ),
    # router/stream.py: the router resolves a Kafka-native record's adapter name from a snapshot of the registry.
    "lora_read": Feature(commands=("hgetall",), keys=("lora:adapters",)),
    # ingress/responses/store.py and sweeper.py: stored responses (a script sets a field if the hash exists).
    "responses": Feature(
        commands=("hset", "hmget", "hgetall", "set", "get", "del", "expire", "zadd", "zrange", "zrem", *_SCRIPTS),
        keys=("llm:response:*", "llm:responses:*"),
    ),
    # sluicegate/usage/quota.py: reserve (ingress, batch worker) and settle (the rollup) token quotas by script.
    "quota": Feature(
        commands=("get", "incrby", "expire", "expireat", "hset", "hget", "hexists", "del", *_SCRIPTS),
        keys=("llm:quota:*",),
    ),
    # sluicegate/usage/rollup.py (in the router): each usage record added once to hourly aggregates (by script).
    "usage_rollup": Feature(
        commands=("set", "hincrby", "zadd", "expireat", "zremrangebyscore", *_SCRIPTS), keys=("llm:usage:*",)
    ),
    # sluicegate/usage/report.py: GET /v1/usage.
    "usage_report": Feature(commands=("hgetall", "zrangebyscore"), keys=("llm:usage:*",)),
    # sluicegate/batches/files.py: file metadata and the tenant's index.
    "files": Feature(
        commands=("set", "get", "mget", "del", "zadd", "zrem", "zrange", "zrevrange", "multi", "exec"),
        keys=("llm:file:*", "llm:files:*"),
    ),
    # sluicegate/batches/store.py: batch state with CAS transitions by script; batch_service/locks.py's locks.
    "batches": Feature(
        commands=(
            "hset",
            "hsetnx",
            "hget",
            "hgetall",
            "hkeys",
            "hmget",
            "hincrby",
            "zadd",
            "zrange",
            "zrevrange",
            "zrem",
            "zcard",
            "multi",
            "exec",
            "set",
            "get",
            "del",
            "pexpire",
            *_SCRIPTS,
        ),
        keys=("llm:batch:*", "llm:batches:*", "llm:batch-collector:*"),
    ),
    # sluicegate/batches/celery_app.py's kick: kombu declares the queue (its binding set) and LPUSHes a task.
    # sluicegate/batches/celery_app.py's kick: kombu declares the queue (its binding set, refreshed by a script:
    # SADD, TIME, ZADD; swept by another: ZRANGEBYSCORE, EXISTS, DEL, ZREM), checks its length and LPUSHes a task.
    "celery_send": Feature(
        commands=(
            "lpush",
            "llen",
            "sadd",
            "srem",
            "smembers",
            "exists",
            "del",
            "time",
            "zadd",
            "zrangebyscore",
            "zrem",
            "multi",
            "exec",
            *_SCRIPTS,
        ),
        keys=("*sluicegate-batch*", "_kombu.*"),
    ),
    # A Celery worker on kombu's Redis transport: BRPOP the queue, the unacked hash/index/mutex of late acks, the
    # pidbox and event channels (the prefix is kombu's global_keyprefix).
    "celery_work": Feature(
        commands=(
            "brpop",
            "lpush",
            "rpush",
            "llen",
            "sadd",
            "srem",
            "smembers",
            "multi",
            "exec",
            "watch",
            "unwatch",
            "zadd",
            "zrem",
            "zrangebyscore",
            "zrevrangebyscore",
            "hset",
            "hget",
            "hdel",
            "get",
            "set",
            "setnx",
            "del",
            "expire",
            "publish",
            "subscribe",
            "psubscribe",
            "unsubscribe",
            "punsubscribe",
            "scan",
        ),
        keys=("*sluicegate-batch*", "_kombu.*", "unacked*", "*.celery.pidbox*", "*.reply.celery.pidbox*"),
        channels=("*",),
    ),
}

#: Each service's features: what its code (and the shared modules it runs) sends to Redis.
SERVICES: dict[str, tuple[str, ...]] = {
    "ingress": (
        "stream_read",
        "stream_write",
        "request_state",
        "heartbeat_read",
        "ingress_limits",
        "route_rollbacks",
        "lora",
        "responses",
        "quota",
        "usage_report",
        "files",
        "batches",
        "celery_send",
    ),
    "result-service": ("stream_read", "request_state"),
    "worker": ("stream_write", "ownership", "request_state", "heartbeat_write", "heartbeat_read", "lora"),
    "router": (
        "stream_write",
        "request_state",
        "heartbeat_read",
        "route_rollbacks",
        "lora_read",
        "quota",
        "usage_rollup",
    ),
    "batch-worker": (
        "stream_read",
        "request_state",
        "heartbeat_read",
        "route_rollbacks",
        "lora",
        "quota",
        "files",
        "batches",
        "celery_send",
        "celery_work",
    ),
}


class ServiceAcl(BaseModel):
    """A service's ACL user: its name and the rules that give it exactly its features."""

    model_config = ConfigDict(frozen=True)

    service: str
    user: str
    commands: tuple[str, ...]
    keys: tuple[str, ...]
    channels: tuple[str, ...]

    def rules(self, password: str) -> list[str]:
        """The ACL rules of this user (``reset`` first, so loading them again replaces the old ones)."""
        if not password or any(ch.isspace() for ch in password):
            raise ValueError(f"{self.service}: an ACL password must be non-empty and without spaces")
        return [
            "reset",
            "on",
            f">{password}",
            *(f"~{key}" for key in self.keys),
            *(f"&{channel}" for channel in self.channels),
            "-@all",
            *(f"+{command}" for command in self.commands),
        ]

    def setuser(self, password: str) -> str:
        """The ``ACL SETUSER`` command that creates (or replaces) this user."""
        return " ".join(["ACL", "SETUSER", self.user, *self.rules(password)])

    def acl_file_line(self, password: str) -> str:
        """This user as a line of a redis-server ``aclfile``."""
        return " ".join(["user", self.user, *self.rules(password)])

    def probe_keys(self) -> list[str]:
        """One key under each of its patterns: what the start-up check asks about."""
        return [key.replace("*", "acl-probe") for key in self.keys]


def service_acl(service: str, prefix: str = "") -> ServiceAcl:
    """The ACL user of ``service`` (one of :data:`SERVICES`) for a deployment under topic prefix ``prefix``."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")
    features = [FEATURES[name] for name in SERVICES[service]]
    commands = sorted({command for f in features for command in (*_CONNECTION, *f.commands)})
    keys = sorted({prefix + key for f in features for key in f.keys})
    # Channels stay unprefixed: kombu's pidbox subscribes to fanout channels without its global key prefix.
    channels = sorted({channel for f in features for channel in f.channels})
    return ServiceAcl(
        service=service,
        user=f"sluicegate-{service}",
        commands=tuple(commands),
        keys=tuple(keys),
        channels=tuple(channels),
    )


def all_acls(prefix: str = "") -> list[ServiceAcl]:
    """Every service's ACL user, in :data:`SERVICES` order."""
    return [service_acl(service, prefix) for service in SERVICES]


def setuser_lines(prefix: str, passwords: Mapping[str, str], services: Sequence[str] | None = None) -> list[str]:
    """``ACL SETUSER`` lines for ``services`` (default: all), each with its password from ``passwords``."""
    missing = [s for s in services or SERVICES if s not in passwords]
    if missing:
        raise ValueError(f"no password for {', '.join(missing)}")
    return [service_acl(s, prefix).setuser(passwords[s]) for s in services or SERVICES]
