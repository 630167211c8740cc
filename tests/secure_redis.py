"""A redis-server of a test's own that speaks TLS only and knows each service's ACL user (for one topic prefix),
started the way ``sluicegate dev up`` starts one with ``SLUICEGATE_REDIS_TLS=true``; optionally a Sentinel over
TLS with ACL users of its own in front of it. This module is also a pytest plugin (``tests/conftest.py`` loads it):
fixture ``secure_redis_server`` is one such server for the whole session."""

from __future__ import annotations

import contextlib
import secrets
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from needs import require_tool
from ports import free_port

from cli.backbone.redis_server import tls_server_args, write_acl_file
from cli.backbone.redis_tls import TlsFiles, make_tls_files
from sluicegate.redis_acl import SERVICES, service_acl

ADMIN = "sluicegate-admin"
SENTINEL_USER = "sentinel-client"


@dataclass
class SecureRedis:
    """Where the server listens, its certificates and each ACL user's password."""

    port: int
    tls: TlsFiles
    prefix: str
    passwords: dict[str, str]
    admin_password: str
    processes: list[subprocess.Popen] = field(default_factory=list)
    sentinel_port: int | None = None
    sentinel_password: str = ""

    def url(self, service: str | None = None, *, query: str | None = None) -> str:
        """``rediss://`` as ``service``'s user (the admin when None), checked against the test CA."""
        user, password = (ADMIN, self.admin_password) if service is None else (
            service_acl(service).user, self.passwords[service])  # fmt: skip
        return f"rediss://{user}:{password}@127.0.0.1:{self.port}/0?{self.tls.url_query() if query is None else query}"

    def sentinel_url(self, service: str) -> str:
        """``rediss+sentinel://`` as ``service``'s user, the Sentinel asked as its own client user."""
        assert self.sentinel_port is not None, "started without a Sentinel"
        user = service_acl(service).user
        return (
            f"rediss+sentinel://{user}:{self.passwords[service]}@127.0.0.1:{self.sentinel_port}/primary/0"
            f"?sentinel_username={SENTINEL_USER}&sentinel_password={self.sentinel_password}&{self.tls.url_query()}"
        )


def _wait_port(port: int, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{what} exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} on port {port} did not start")


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def secure_redis(folder: Path, prefix: str, *, sentinel: bool = False) -> Iterator[SecureRedis]:
    """A TLS-only redis-server with every service's ACL user (and a Sentinel), stopped on the way out."""
    server = require_tool("redis-server", "apt-get install redis-server")
    folder.mkdir(parents=True, exist_ok=True)
    tls = make_tls_files(folder / "tls")
    passwords = {service: secrets.token_urlsafe(12) for service in SERVICES}
    redis = SecureRedis(free_port(), tls, prefix, passwords, secrets.token_urlsafe(12))
    acl_file = write_acl_file(folder / "users.acl", prefix, passwords, admin_password=redis.admin_password)
    # The admin is a named user, not 'default': the default user is switched off, as a hardened server has it.
    acl_file.write_text(
        acl_file.read_text().replace(f"user default on >{redis.admin_password}", "user default off")
        + f"user {ADMIN} on >{redis.admin_password} ~* &* +@all\n"
    )
    try:
        args = [*tls_server_args(tls, redis.port), "--aclfile", str(acl_file)]
        process = _spawn([server, *args, "--bind", "127.0.0.1", "--save", "", "--dir", str(folder)], folder / "r.log")
        redis.processes.append(process)
        _wait_port(redis.port, process, "redis-server")
        if sentinel:
            sentinel_bin = require_tool("redis-sentinel", "apt-get install redis-sentinel")
            redis.sentinel_port, redis.sentinel_password = free_port(), secrets.token_urlsafe(12)
            conf = folder / "sentinel.conf"
            conf.write_text(
                "\n".join(
                    [
                        "port 0",
                        f"tls-port {redis.sentinel_port}",
                        f"tls-cert-file {tls.server_cert}",
                        f"tls-key-file {tls.server_key}",
                        f"tls-ca-cert-file {tls.ca}",
                        "tls-auth-clients optional",
                        "tls-replication yes",
                        "bind 127.0.0.1",
                        f"sentinel monitor primary 127.0.0.1 {redis.port} 1",
                        f"sentinel auth-user primary {ADMIN}",
                        f"sentinel auth-pass primary {redis.admin_password}",
                        "user default off",
                        f"user {SENTINEL_USER} on >{redis.sentinel_password} allchannels +@all",
                    ]
                )
                + "\n"
            )
            process = _spawn([sentinel_bin, str(conf)], folder / "s.log")
            redis.processes.append(process)
            _wait_port(redis.sentinel_port, process, "redis-sentinel")
        yield redis
    finally:
        for process in redis.processes:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="session")
def secure_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureRedis]:
    """The session's TLS-only Redis (started on first use). Its ACL users are those of one topic prefix
    (``.prefix``), so a pipeline on it runs under that prefix: one pipeline at a time."""
    with secure_redis(tmp_path_factory.mktemp("secure-redis"), f"s{uuid.uuid4().hex[:8]}.") as redis:
        yield redis
