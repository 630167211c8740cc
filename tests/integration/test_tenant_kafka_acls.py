"""Tenants apart on a real ACL-enforcing broker (SASL_SSL, StandardAuthorizer, nothing allowed without an ACL):
SCRAM users for the router, a model's workers and two tenants, and exactly the ACLs ``sluicegate kafka acls
--tenant-topics --json`` prints. The router and a tiny worker under their own principals serve tenant-a's
request end to end; tenant-a's principal writes its inbound topic and reads its results, and every read or write
of tenant-b's topics, of the shared control topic and of a model topic (around the router) is refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import acl_support
import pytest
from acl_support import add_users, admin_client, apply_acls, as_user, printed_acls
from aiokafka.errors import TopicAuthorizationFailedError
from ingress_support import eventually, wait_partitions_owned
from redis.asyncio import Redis
from secure_kafka import SecureKafka

from gpu_workers.worker.main import run_worker
from router.stream import run_router
from schemas import FinalResult, InferenceRequest
from sluicegate.kafka import create_consumer, create_producer, start_client
from sluicegate.kafka_acls import tenant_principal, worker_principal
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "tiny-acl"
TENANTS = ["tenant-a", "tenant-b"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("acl-model") / MODEL, num_layers=2, hidden_size=64)


@pytest.fixture
async def principals(acl_kafka: SecureKafka, test_settings: Settings, tmp_path: Path) -> dict[str, Path]:
    """Each principal's password file, its user made and the printed ACLs applied (all under the test's prefix)."""
    admin = admin_client(acl_kafka)
    users = ["router", worker_principal(MODEL), *map(tenant_principal, TENANTS)]
    files = await add_users(admin, users, tmp_path)
    acls = printed_acls(test_settings.topic_prefix, [MODEL], TENANTS)
    assert await apply_acls(admin, acls) == len(acls) > 0
    return files


@pytest.fixture
async def serving(
    acl_kafka: SecureKafka, test_settings: Settings, redis: Redis, model_dir: Path, principals: dict[str, Path]
) -> AsyncIterator[Settings]:
    """The router and a worker running as their principals until the test ends; the deployment's settings."""
    settings = test_settings.model_copy(
        update={
            "tenant_topics": True,
            "tenants": ",".join(TENANTS),
            "topic_partitions": 1,
            "topic_replication": 1,
            "served_models": MODEL,
            "model": str(model_dir),
            "model_name": MODEL,
            "worker_id": "w-acl",
            "engine_mode": "thread",
            "kv_cache_gb": 0.05,
            "drain_timeout_s": 5.0,
        }
    )
    worker_name = worker_principal(MODEL)
    stop = asyncio.Event()
    router = asyncio.create_task(run_router(as_user(settings, acl_kafka, "router", principals["router"]), stop=stop))
    worker = asyncio.create_task(run_worker(as_user(settings, acl_kafka, worker_name, principals[worker_name]), stop))

    try:
        await wait_partitions_owned(redis, settings, MODEL, router, worker)
        yield settings
        for task in (router, worker):
            assert not task.done(), task.exception()
    finally:
        stop.set()
        await asyncio.gather(asyncio.wait_for(router, 30), asyncio.wait_for(worker, 60), return_exceptions=True)


async def _write_refused(settings: Settings, topic: str) -> bool:
    producer = create_producer(settings)
    await start_client(producer, settings)
    try:
        await producer.send_and_wait(topic, b"{}")
    except TopicAuthorizationFailedError:
        return True
    finally:
        await producer.stop()
    return False


async def test_a_tenant_reaches_only_its_own_topics_and_is_served(
    acl_kafka: SecureKafka, serving: Settings, principals: dict[str, Path], redis: Redis
) -> None:
    names = serving.names
    principal = tenant_principal("tenant-a")
    tenant_a = as_user(serving, acl_kafka, principal, principals[principal])
    # Its own: a Kafka-native request on its inbound topic, its result read in a group of its own.
    request = InferenceRequest(request_id="acl-served", model=MODEL, prompt="hello", sampling={"max_tokens": 3})
    producer = create_producer(tenant_a)
    await start_client(producer, tenant_a)
    try:
        await producer.send_and_wait(
            names.tenant_inbound_topic("tenant-a"), request.model_dump_json(exclude={"tenant"}).encode()
        )
    finally:
        await producer.stop()
    results = create_consumer(names.results_topic_of("tenant-a"), group_id="tenant-a.results", settings=tenant_a)
    await start_client(results, tenant_a)
    try:
        got: list[FinalResult] = []
        deadline = time.monotonic() + 120
        while not got and time.monotonic() < deadline:
            for records in (await results.getmany(timeout_ms=500)).values():
                got += [FinalResult.model_validate_json(r.value) for r in records]
        await results.commit()
    finally:
        await results.stop()
    assert [(r.request_id, r.tenant, r.finish_reason) for r in got] == [("acl-served", "tenant-a", "length")]
    # The usage rollup in the router's process read the worker's usage record as the router.
    await eventually(lambda: redis.exists(names.usage_hours_key("tenant-a")), timeout_s=60)

    # Anyone else's: each refused by the broker.
    writes = [
        names.tenant_inbound_topic("tenant-b"),
        names.control_topic,
        names.control_topic_of("tenant-b"),
        *names.request_topics(MODEL),
    ]
    reads = [names.results_topic_of("tenant-b"), names.dlq_topic_of("tenant-b"), names.results_topic]
    crossed = [f"write {t}" for t in writes if not await _write_refused(tenant_a, t)]
    password = principals[principal]

    async def read_refused(topic: str) -> bool:
        return await asyncio.to_thread(
            acl_support.read_refused, acl_kafka, principal, password, topic, "tenant-a.probe"
        )

    crossed += [f"read {t}" for t in reads if not await read_refused(t)]
    assert crossed == []
    assert not await read_refused(names.results_topic_of("tenant-a"))  # the probe reads what may be read
    print(f"\nKAFKA-ISOLATION refused={len(writes) + len(reads)} cross_tenant={len(crossed)} served=1")
