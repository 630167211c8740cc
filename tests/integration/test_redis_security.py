"""Redis over TLS with per-service ACL users, on a real TLS-only redis-server (and Sentinel): stream appends and
reads through the pipeline's client factory under the worker's and the relay's users, a Sentinel over TLS with
usernames finding the primary, Celery's broker checking the certificate, and the one-line start-up refusals."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from secure_redis import SecureRedis, secure_redis

from schemas import Names
from sluicegate.batches.celery_app import _app
from sluicegate.lora.registry import LoRARegistry
from sluicegate.redis_access import RedisAccessError, check_redis_access
from sluicegate.redis_acl import service_acl
from sluicegate.redis_client import create_redis
from sluicegate.settings import RedisSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureRedis]:
    with secure_redis(tmp_path_factory.mktemp("secure-redis"), f"s{uuid.uuid4().hex[:6]}.", sentinel=True) as redis:
        yield redis


async def test_stream_append_and_read_under_service_users(server: SecureRedis) -> None:
    key = Names(server.prefix).stream_key("r1")
    writer = create_redis(url=server.url("worker"))
    reader = create_redis(url=server.url("result-service"))
    try:
        for seq in (1, 2):
            await writer.xadd(key, {"seq": str(seq)}, id=f"{seq}-0")
        await writer.expire(key, 60)
        [(stream, entries)] = await reader.xread({key: "0-0"})
        assert stream == key.encode() and [fields[b"seq"] for _, fields in entries] == [b"1", b"2"]
        # The relay's user reads streams; it may not write them.
        with pytest.raises(Exception, match="no permissions to run the 'xadd' command"):
            await reader.xadd(key, {"seq": "3"}, id="3-0")
    finally:
        await writer.aclose()
        await reader.aclose()


async def test_router_reads_the_lora_registry_but_may_not_change_it(server: SecureRedis) -> None:
    # The router resolves a Kafka-native record's adapter from the registry the workers keep.
    router = create_redis(url=server.url("router"))
    try:
        assert await LoRARegistry(router, server.prefix).list() == []
        with pytest.raises(Exception, match="no permissions to run the 'hdel' command"):
            await LoRARegistry(router, server.prefix).unregister("any")
    finally:
        await router.aclose()


async def test_sentinel_over_tls_with_users_finds_the_primary(server: SecureRedis) -> None:
    client = create_redis(url=server.sentinel_url("worker"))
    try:
        key = Names(server.prefix).stream_key("via-sentinel")
        assert await client.xadd(key, {"seq": "1"}, id="1-0") == b"1-0"
        assert (await client.connection_pool.get_master_address())[1] == server.port
    finally:
        await client.aclose()
    # A misspelt parameter is refused by name rather than silently dropping the Sentinel's credentials.
    anonymous = server.sentinel_url("worker").replace("sentinel_username=", "x=").split("&sentinel_password=")[0]
    with pytest.raises(ValueError, match="unknown query parameter"):
        create_redis(url=anonymous)


def test_celery_broker_checks_the_certificate(server: SecureRedis) -> None:
    """kombu over rediss:// with the CA connects as the batch worker's user; without the CA the check fails (it
    is on), where kombu left alone would have connected unchecked."""
    app = _app(server.url("batch-worker"), server.prefix, 30)
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)
        assert conn.default_channel.client.ping()
    unchecked = _app(server.url("batch-worker", query=""), server.prefix, 30)
    with unchecked.connection_for_write() as conn, pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        conn.ensure_connection(max_retries=0)
        conn.default_channel.client.ping()


async def test_start_up_refusals_are_one_line(server: SecureRedis) -> None:
    settings = RedisSettings()
    right = server.url("worker")

    async def refusal(url: str, keys: tuple[str, ...] = ()) -> str:
        with pytest.raises(RedisAccessError) as caught:
            await check_redis_access(settings, url=url, keys=keys)
        message = str(caught.value)
        assert "\n" not in message and server.passwords["worker"] not in message, message
        return message

    await check_redis_access(settings, url=right, keys=service_acl("worker", server.prefix).probe_keys())
    assert "(WRONGPASS)" in await refusal(right.replace(server.passwords["worker"], "wrong"))
    assert "certificate was not accepted" in await refusal(server.url("worker", query=""))
    plain = right.replace("rediss://", "redis://").split("?")[0]
    assert "use rediss://" in await refusal(plain)
    # The relay's user may not touch the workers' heartbeats: the refusal names the key.
    key = Names(server.prefix).workers_key("m")
    message = await refusal(server.url("result-service"), (key,))
    assert "(NOPERM" in message and repr(key) in message, message


def test_acl_lines_load_into_redis(server: SecureRedis, tmp_path: Path) -> None:
    """The `sluicegate redis acls` lines are valid ACL SETUSER commands (the server takes each one)."""
    import redis

    admin = redis.Redis.from_url(server.url())
    try:
        for service in ("ingress", "batch-worker"):
            line = (
                service_acl(service, server.prefix)
                .setuser("pw-" + service)
                .replace(f"sluicegate-{service}", f"check-{service}", 1)
            )
            assert admin.execute_command(*line.split()) in (b"OK", True)
            assert admin.execute_command("ACL", "DELUSER", f"check-{service}") == 1
    finally:
        admin.close()
