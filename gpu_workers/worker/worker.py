"""The GPU worker: consumes a model's request topics, runs the engine, streams events to Redis.

:class:`Worker` owns the state its parts share and runs them; each guarantee below is kept in one file
(see docs/design.md, request flow 3-5):

* tiers drain in order (interactive, standard, batch): a tier starts requests while the worker runs fewer
  than ``max_in_flight`` of that tier or above, so lower-tier work never keeps a higher-tier request out, and
  its partitions are paused once ``intake_hold`` of its records are fetched and not started, so the rest of
  the backlog stays in Kafka, not in worker memory (:mod:`.intake`);
* held records start earliest deadline first, then tenant by tenant by tokens (:mod:`.fair_intake`), so one
  tenant's backlog of long prompts ahead in Kafka does not crowd out another's; ``max_in_flight`` is a
  lookahead past the engine's seats, and each request carries its tenant, so the engine's fair queuing
  serves the tenants evenly over what runs (:mod:`.intake`, :mod:`.serving`);
* an offset is committed only when every request at or below it reached an outcome (``done`` or
  ``error`` in its stream, or a dead letter); a crash or a drain timeout re-delivers the rest
  (:mod:`.intake`, :mod:`.offsets`);
* a re-delivered request continues from the tokens its stream already holds, with text that joins
  the delivered text exactly (:mod:`.serving`, :mod:`.resume`); one whose stream already ended is skipped;
* a cancel (control topic, or the Redis marker checked at pick-up) aborts the engine sequence
  (:mod:`.control`);
* a request naming a LoRA adapter runs with it, looked up in the Redis registry and loaded on demand; an
  unknown or unloadable adapter fails that request with an ``error`` event (:mod:`.adapters`, :mod:`.serving`);
* a message that cannot be decoded or served goes to ``llm.dlq`` with a ``reason`` header
  (:mod:`sluicegate.record_check`, :mod:`.serving`);
* final results (``llm.results``) and dead letters are retried until Kafka takes them (at-least-once)
  (:mod:`.outputs`);
* one owner at a time writes a request's stream: every pick-up raises the request's owner epoch and every write
  is refused once a newer owner has taken over; a fenced request stops at once (:mod:`.fencing`);
* every event of one flush goes to Redis in one pipelined round trip, with entry ids from ``seq``;
  Redis outages are waited out with backoff, never turned into lost or failed requests
  (:mod:`.streams`, :mod:`.outputs`).

See docs/reliability.md for the fault tests behind each guarantee.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener

from gpu_workers.engine import EngineFront
from schemas import TIERS, Names, WorkerHeartbeat
from sluicegate.lora.checks import serve_checks
from sluicegate.task_stop import cancel_and_wait

from .adapters import Adapters
from .config import WorkerConfig
from .control import Cancels, control_topics
from .fencing import Fence
from .heartbeat import Heartbeats
from .in_flight import InFlight
from .intake import Intake
from .kv_events import KVEventPublisher
from .observer import WorkerObserver
from .outputs import Outputs
from .reader_leases import ReaderWatch
from .serving import Serving
from .telemetry import WorkerTelemetry

log = logging.getLogger(__name__)


class Worker:
    """One engine, one consumer-group member, one Redis publisher."""

    def __init__(
        self,
        engine: EngineFront,
        config: WorkerConfig,
        *,
        names: Names,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        consumer: AIOKafkaConsumer,
        control_consumer: AIOKafkaConsumer,
        observer: WorkerObserver | None = None,
        telemetry: WorkerTelemetry | None = None,
        stream_redis: aioredis.Redis | None = None,
        adapters: Adapters | None = None,
    ) -> None:
        self.engine = engine
        self.adapters = adapters  # LoRA serving; None when the worker serves the base model only
        if telemetry is None and config.metrics:
            telemetry = WorkerTelemetry(engine, config.model_name, config.worker_id)
        self.telemetry = telemetry
        self.config = config
        self.names = names
        self._stopping = asyncio.Event()
        self.in_flight = InFlight()
        self.fence = Fence(engine, self.in_flight, config.worker_id)
        self.outputs = Outputs(config, names, redis, producer, observer, stream_redis, self.fence.refused)
        self.cancels = Cancels(control_consumer, engine, self.in_flight, control_topics(names, config.tenants))
        self.serving = Serving(engine, names, redis, self.outputs, self.in_flight, self.cancels, adapters)
        self.intake = Intake(
            consumer, engine, config, names, self.in_flight, self.serving, self.outputs, self._stopping, observer
        )
        self.readers = ReaderWatch(redis, names, self.in_flight, self.cancels, config.reader_lease_s)
        self.heartbeats = Heartbeats(engine, config, names, redis, producer, consumer, self._stopping, adapters)
        self.kv_events = (
            KVEventPublisher(engine, producer, names, config.model_name, config.worker_id) if config.kv_events else None
        )
        self.heartbeats.kv_events = self.cancels.kv_events = self.kv_events
        self._redis = redis
        if telemetry is not None:
            telemetry.set_topics({names.request_topic(config.model_name, t): t for t in TIERS})
        self.outputs.telemetry = self.serving.telemetry = self.intake.telemetry = self.heartbeats.telemetry = telemetry
        self.fence.telemetry = telemetry

    def readiness(self) -> tuple[bool, str]:
        """Ready to serve: the engine runs, the consumer has joined its group and the last heartbeat write
        succeeded recently (the readiness probe of ``/readyz``)."""
        if not self.engine.is_running:
            return False, "engine not running"
        if not self.intake.joined:
            return False, "consumer has not joined its group"
        last = self.heartbeats.last_written
        if last is None or time.monotonic() - last > 3 * self.config.heartbeat_interval_s:
            return False, "no recent heartbeat write"
        if self._stopping.is_set():
            return False, "draining"
        return True, "ready"

    @property
    def topics(self) -> list[str]:
        return self.intake.topics

    def rebalance_listener(self) -> ConsumerRebalanceListener:
        return self.intake.rebalance_listener()

    def heartbeat(self) -> WorkerHeartbeat:
        return self.heartbeats.beat()

    # Counters for logs and tests.
    @property
    def served(self) -> int:
        return self.serving.served

    @property
    def resumed(self) -> int:
        return self.serving.resumed

    @property
    def cancelled_before_start(self) -> int:
        return self.serving.cancelled_before_start

    @property
    def dead_lettered(self) -> int:
        return self.outputs.dead_lettered

    async def run(self, stop: asyncio.Event, *, start_consumer: bool = False) -> None:
        """Serve until ``stop`` is set, then drain in-flight requests and commit.

        With ``start_consumer`` the group consumer is started here, after heartbeats and the control
        consumer are running: joining a group waits for the first assignment, which during a rebalance
        that waits on a dead member takes up to a session timeout, and the worker must not look absent
        (ingress refuses a model without a live heartbeat) nor miss cancels meanwhile.
        """
        loops = [
            asyncio.create_task(self.intake.run(start_consumer), name="fetch"),
            asyncio.create_task(self.outputs.flush_loop(), name="flush"),
            asyncio.create_task(self.cancels.run(), name="control"),
            asyncio.create_task(self.heartbeats.run(), name="heartbeat"),
        ]
        if self.kv_events is not None:
            loops.append(asyncio.create_task(self.kv_events.run(), name="kv-events"))
        if self.readers.enabled:
            loops.append(asyncio.create_task(self.readers.run(), name="readers"))
        if self.adapters is not None:  # this worker verifies adapter registrations for its model (ingress asks)
            checks = serve_checks(self._redis, self.names.prefix, self.config.model_name, self.adapters.verify)
            loops.append(asyncio.create_task(checks, name="lora-checks"))
        if self.telemetry is not None:
            sampler = self.telemetry.sample_backlog(
                self.intake.consumer, self.engine, self.config.heartbeat_interval_s, self.intake.held_by_tier
            )
            loops.append(asyncio.create_task(sampler, name="backlog-sampler"))
        stopper = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*loops, stopper], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            self._stopping.set()
            stopper.cancel()
            await self._drain()
            await cancel_and_wait(*loops)
            await self.heartbeats.remove()

    async def _drain(self) -> None:
        """Stop taking work, let what runs finish (bounded), then flush and commit."""
        self.intake.pause()
        tasks = self.in_flight.tasks()
        if tasks:
            log.info("worker.draining", extra={"in_flight": len(tasks)})
            _, pending = await asyncio.wait(tasks, timeout=self.config.drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        # Bounded: with Redis down at shutdown, the unflushed requests are simply re-delivered.
        try:
            await asyncio.wait_for(self.outputs.flush(), self.config.drain_timeout_s)
        except TimeoutError:
            log.warning("worker.final_flush_timed_out", extra={"pending": self.outputs.publisher.pending})
        await self.intake.final_commit()
