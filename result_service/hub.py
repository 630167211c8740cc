"""The relay's stream hub: the one Redis stream follower (``sluicegate.stream_follower``) decoding
each entry once into the relay's wire event, with the relay's tuning.

Everything about following streams (shared readers, wake-ups, catch-up, dedupe, dropping slow
clients) lives in the follower; this module only binds it to :func:`result_service.wire.to_relayed`.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from schemas import Names
from sluicegate.stream_follower import FollowerConfig, StreamFollower

from .wire import Relayed, to_relayed


@dataclass(frozen=True)
class RelayConfig(FollowerConfig):
    """Tuning of the relay; the defaults suit one process serving thousands of clients."""

    #: Seconds between SSE keepalive comments while a stream is quiet.
    sse_keepalive_s: float = 15.0
    #: CLIENT SETNAME of every connection, so operators can count the service's connections.
    client_name: str = "sluicegate-result"
    #: Streams one multiplexed socket (``/v1/streams``) may follow at once; each holds a task and a buffer.
    mux_max_streams: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sse_keepalive_s <= 0:
            raise ValueError(f"RelayConfig.sse_keepalive_s must be > 0, got {self.sse_keepalive_s}")
        if self.mux_max_streams < 1:
            raise ValueError(f"RelayConfig.mux_max_streams must be >= 1, got {self.mux_max_streams}")


class StreamHub(StreamFollower[Relayed]):
    """Subscriptions to request streams whose items are ready-to-send :class:`Relayed` events."""

    config: RelayConfig

    def __init__(self, redis: Redis, names: Names, config: RelayConfig | None = None) -> None:
        super().__init__(redis, names, config or RelayConfig(), decode=to_relayed)
