"""Tenants apart in Redis, on a real redis-server of the test's own with ACL users made from
``Names.tenant_key_patterns``: a tenant's reader reads its own streams, request records and cancel markers, and
every read of another tenant's (one whose name starts like its own included) is refused with NOPERM."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from private_redis import RedisServer, private_redis
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError

from schemas import Names

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TENANTS = ("tenant-a", "tenant-b", "tenant-a:x")  # the last one's name starts as tenant-a's does
#: What the docs give a tenant's reader (docs/deploy.md, "Tenants apart on the broker").
READER_COMMANDS = ["+xread", "+xrange", "+get", "+exists"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with private_redis(tmp_path) as running:
        yield running


@pytest.fixture
async def admin(server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(server.url)
    yield client
    await client.aclose()


async def _reader(server: RedisServer, admin: Redis, names: Names, tenant: str) -> Redis:
    """A client logged in as ``tenant``'s read-only user, whose keys are exactly its tenant's patterns."""
    user = f"reader-{tenant}"
    await admin.acl_setuser(
        user,
        enabled=True,
        passwords=[f"+pw-{tenant}"],
        keys=names.tenant_key_patterns(tenant),
        commands=READER_COMMANDS,
        reset=True,
    )
    return Redis.from_url(server.url, username=user, password=f"pw-{tenant}")


async def test_a_tenants_reader_reads_only_its_own_keys(server: RedisServer, admin: Redis) -> None:
    names = Names("iso.", tenants_apart=True)
    for tenant in TENANTS:
        await admin.xadd(names.stream_key("r1", tenant), {"event": f"of {tenant}"})
        await admin.set(names.request_key("r1", tenant), f"record of {tenant}")
        await admin.set(names.cancel_key("r1", tenant), "1")
    reader = await _reader(server, admin, names, "tenant-a")
    try:
        own = await reader.xread({names.stream_key("r1", "tenant-a"): "0"})
        assert [fields for _, entries in own for _, fields in entries] == [{b"event": b"of tenant-a"}]
        assert len(await reader.xrange(names.stream_key("r1", "tenant-a"))) == 1
        assert await reader.get(names.request_key("r1", "tenant-a")) == b"record of tenant-a"
        assert await reader.exists(names.cancel_key("r1", "tenant-a")) == 1

        reads = {
            "xread": lambda t: reader.xread({names.stream_key("r1", t): "0"}),
            "xread both": lambda t: reader.xread(
                {names.stream_key("r1", "tenant-a"): "0", names.stream_key("r1", t): "0"}
            ),
            "xrange": lambda t: reader.xrange(names.stream_key("r1", t)),
            "get record": lambda t: reader.get(names.request_key("r1", t)),
            "exists cancel": lambda t: reader.exists(names.cancel_key("r1", t)),
        }
        crossed = []
        for other in TENANTS[1:]:
            for what, read in reads.items():
                try:
                    await read(other)
                except NoPermissionError as refused:
                    assert "permission" in str(refused), refused
                else:
                    crossed.append((other, what))
        assert crossed == []
        with pytest.raises(NoPermissionError):  # nor a key of the shared mode, which carries no tenant
            await reader.xread({Names("iso.").stream_key("r1"): "0"})
        # Nor may it write, delete or list keys: the user has only the read commands.
        for command in (("XADD", names.stream_key("r1", "tenant-a"), "*", "f", "v"), ("KEYS", "*"), ("DEL", "x")):
            with pytest.raises(NoPermissionError):
                await reader.execute_command(*command)
    finally:
        await reader.aclose()
    print(f"\nREDIS-ISOLATION tenants={len(TENANTS)} refused={len(reads) * 2} cross_tenant_reads={len(crossed)}")
