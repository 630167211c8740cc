"""The local Redis: find (or, as root on Debian, install) ``redis-server`` and start it in the background on
``redis_port``, bound to 127.0.0.1, with its data and log under the state folder. With ``redis_tls`` it speaks TLS
only (``port 0``, ``tls-port`` = ``redis_port``, certificates from :mod:`cli.backbone.redis_tls`) and loads each
service's ACL user (:mod:`sluicegate.redis_acl`) from an aclfile.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

from cli.backbone.redis_tls import TlsFiles, make_tls_files
from cli.stack.layout import DevStackError, StackLayout
from cli.stack.processes import Owner, log, spawn
from sluicegate.redis_acl import all_acls
from sluicegate.redis_urls import mask_url

REDIS_START_TIMEOUT_S = 15.0
REDIS_STOP_TIMEOUT_S = 10.0
REDIS_HINT = "install it (apt-get install redis-server, or brew install redis)"


def find_redis_server() -> str:
    """``redis-server`` on the PATH; as root with apt-get, installed first when missing."""
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DevStackError(f"redis-server not found: {REDIS_HINT}")
    log.info("devstack.installing package=redis-server via=apt-get")
    # RUNLEVEL=1 keeps the package's init script from starting a system Redis on port 6379.
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"]
    result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:  # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    found = shutil.which("redis-server")
    if found is None:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise DevStackError(f"redis-server not found and `apt-get install redis-server` failed: {reason}")
    return found


def redis_owner(layout: StackLayout) -> Owner:
    """Recognises this instance's server by its binary and its port."""
    port = str(layout.redis_port)
    # redis-server rewrites its title to "redis-server 127.0.0.1:<port>" once started.
    return lambda tokens: (
        any("redis-server" in t for t in tokens) and any(t == port or t.endswith(f":{port}") for t in tokens)
    )


def tls_server_args(files: TlsFiles, tls_port: int) -> list[str]:
    """redis-server arguments for TLS only on ``tls_port`` (plaintext off), client certificates optional."""
    return [
        "--port", "0", "--tls-port", str(tls_port),
        "--tls-cert-file", str(files.server_cert), "--tls-key-file", str(files.server_key),
        "--tls-ca-cert-file", str(files.ca), "--tls-auth-clients", "optional",
    ]  # fmt: skip


def write_acl_file(path: Path, prefix: str, passwords: dict[str, str], admin_password: str | None = None) -> Path:
    """An aclfile at ``path`` with each service's user (``passwords``: service -> password) and the ``default``
    user as the administrator (``admin_password``, or none: a local stack's own)."""
    admin = f">{admin_password}" if admin_password else "nopass"
    lines = [f"user default on {admin} ~* &* +@all"]
    lines += [acl.acl_file_line(passwords[acl.service]) for acl in all_acls(prefix)]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


def acl_passwords(layout: StackLayout) -> dict[str, str]:
    """The local stack's service passwords (service -> password), made once and kept beside its data."""
    path = layout.redis_acl_passwords
    if path.exists():
        return dict(json.loads(path.read_text()))
    passwords = {acl.service: secrets.token_urlsafe(24) for acl in all_acls()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(passwords, indent=2))
    path.chmod(0o600)
    return passwords


def _tls_and_users(layout: StackLayout, prefix: str) -> list[str]:
    try:
        files = make_tls_files(layout.redis_tls_dir)
    except RuntimeError as exc:
        raise DevStackError(str(exc)) from exc
    acl_file = write_acl_file(layout.redis_dir / "users.acl", prefix, acl_passwords(layout))
    return [*tls_server_args(files, layout.redis_port), "--aclfile", str(acl_file)]


def start_redis(layout: StackLayout, server: str, prefix: str = "") -> int:
    """Start ``server`` for this instance (with TLS and the ACL users of a deployment under ``prefix`` when the
    layout says so); returns its pid (not yet ready)."""
    data = layout.redis_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    listen = _tls_and_users(layout, prefix) if layout.redis_tls else ["--port", str(layout.redis_port)]
    cmd = [
        server,
        *listen,
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data),
        "--daemonize",
        "no",
        "--appendonly",
        "no",
        "--save",
        "900 1",
    ]
    pid = spawn(cmd, layout.redis_log, layout.redis_dir, layout.redis_pid)
    log.info("devstack.redis_spawned pid=%d url=%s", pid, mask_url(layout.redis_url))
    return pid
