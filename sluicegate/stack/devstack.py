"""The local dev stack behind ``sluicegate dev up|status|down``: a single-node Kafka (KRaft, broker and
controller in one JVM, jars fetched from Maven Central) and a Redis server, run as background
processes whose pid files, data and logs live under ``Settings.state_dir``.

Layout of the state folder (``.sluicegate/`` by default, git-ignored)::

    kafka/libs/<version>/*.jar   broker jars, fetched once with Maven and shared by every instance
    kafka-<port>/                one broker: server.properties, cluster.id, data/, logs/, kafka.pid
    redis-<port>/                one Redis: data/, redis.log, redis.pid

Instances are keyed by port, so a test session on other ports shares the jar cache but never
touches a developer's running stack. POSIX only (process groups, flock, /proc where present).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sluicegate.kafka import probe_kafka, wait_for_kafka
from sluicegate.redis_client import wait_for_redis
from sluicegate.settings import Settings, get_settings

log = logging.getLogger("sluicegate.devstack")  # stable name also under `python -m`

INFRA_DIR = Path(__file__).resolve().parents[2] / "infra" / "local"
POM = INFRA_DIR / "pom.xml"
SERVER_TEMPLATE = INFRA_DIR / "server.properties.template"
LOG4J_CONFIG = INFRA_DIR / "log4j.properties"

KAFKA_START_TIMEOUT_S = 60.0
REDIS_START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = {"kafka": 30.0, "redis": 10.0}
MIN_JAVA = 11

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

JAVA_HINT = "install a JDK 17+ (apt-get install openjdk-17-jre-headless)"
MAVEN_HINT = "install Maven (apt-get install maven); it fetches the Kafka jars once"
REDIS_HINT = "install it (apt-get install redis-server, or brew install redis)"

T = TypeVar("T")

# Children started by this process, so their exit status is collected (a zombie still has a pid).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class DevStackError(RuntimeError):
    """A problem the user can fix (missing tool, busy port, broker that will not start); the message
    is one line meant to be printed as is."""


# ----------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class StackInfo:
    """What ``up`` brought up: the addresses to use and the processes serving them."""

    kafka_bootstrap: str
    redis_url: str
    kafka_pid: int
    redis_pid: int
    state_dir: Path
    started: tuple[str, ...] = ()  # services this call started; the others were already running
    elapsed_s: float = 0.0

    def env(self) -> dict[str, str]:
        """Environment that points Sluicegate services at this stack."""
        return {"SLUICEGATE_KAFKA_BOOTSTRAP": self.kafka_bootstrap, "SLUICEGATE_REDIS_URL": self.redis_url}

    def lines(self) -> list[str]:
        """Human-readable summary for the CLI."""

        def state(name: str) -> str:
            return "started" if name in self.started else "already running"

        return [
            f"kafka  {self.kafka_bootstrap}  pid {self.kafka_pid} ({state('kafka')})",
            f"redis  {self.redis_url}  pid {self.redis_pid} ({state('redis')})",
            f"state  {self.state_dir}  (ready in {self.elapsed_s:.1f}s)",
            *(f"export {key}={value}" for key, value in self.env().items()),
        ]


@dataclass(frozen=True)
class ServiceStatus:
    """One service of the stack: our process (if any) and whether its address answers."""

    name: str
    address: str
    pid: int | None
    answering: bool
    log_path: Path
    detail: str = ""

    @property
    def running(self) -> bool:
        return self.pid is not None

    def line(self) -> str:
        process = f"pid {self.pid}" if self.pid is not None else "not running"
        health = "answering" if self.answering else "not answering"
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.name:<5}  {self.address}  {process}, {health}{extra}  log {self.log_path}"


@dataclass(frozen=True)
class StackStatus:
    """``status`` result: one entry per service."""

    kafka: ServiceStatus
    redis: ServiceStatus

    @property
    def services(self) -> tuple[ServiceStatus, ...]:
        return (self.kafka, self.redis)

    @property
    def healthy(self) -> bool:
        return all(s.running and s.answering for s in self.services)

    def lines(self) -> list[str]:
        return [s.line() for s in self.services]


# ----------------------------------------------------------------------------------------------------
# Paths and small helpers


@dataclass(frozen=True)
class _Layout:
    state: Path
    kafka_port: int
    redis_port: int

    @classmethod
    def of(cls, settings: Settings) -> _Layout:
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
        return cls(settings.state_dir.expanduser().resolve(), settings.kafka_port, settings.redis_port)

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
    def redis_log(self) -> Path:
        return self.redis_dir / "redis.log"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"


@contextlib.contextmanager
def _locked(layout: _Layout) -> Iterator[None]:
    """Serialise up/down/fetch across processes (parallel test workers, two terminals)."""
    layout.state.mkdir(parents=True, exist_ok=True)
    with open(layout.state / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run_coro(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine from sync code, also when the caller already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.3)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _cmdline_tokens(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").split()


def _alive(pid: int, owns: Callable[[list[str]], bool]) -> bool:
    """True when ``pid`` runs (not a zombie) and its command line is the service we expect, so a
    recycled pid from an old pid file is never mistaken for our process."""
    child = _CHILDREN.get(pid)
    if child is not None:
        # Our own unreaped child cannot have its pid recycled, so poll() is the whole answer. Its command
        # line is not: redis-server rewrites its title just after starting, and a read of
        # /proc/<pid>/cmdline in that moment matches nothing.
        if child.poll() is None:
            return True
        _CHILDREN.pop(pid, None)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # someone else's process: not ours
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        with contextlib.suppress(OSError):
            if stat.read_text().rpartition(")")[2].split()[0] == "Z":
                return False
        tokens = _cmdline_tokens(pid)
        return tokens is not None and owns(tokens)
    return True  # no /proc (macOS): trust the pid file


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _running_pid(pid_file: Path, owns: Callable[[list[str]], bool]) -> int | None:
    """Our live pid for a service, cleaning a stale pid file on the way."""
    pid = _read_pid(pid_file)
    if pid is not None and _alive(pid, owns):
        return pid
    if pid_file.exists():
        log.info("devstack.stale_pid_file file=%s pid=%s", pid_file, pid)
        pid_file.unlink(missing_ok=True)
    return None


def _kafka_owner(layout: _Layout) -> Callable[[list[str]], bool]:
    props = str(layout.kafka_props)
    return lambda tokens: "kafka.Kafka" in tokens and props in tokens


def _redis_owner(layout: _Layout) -> Callable[[list[str]], bool]:
    port = str(layout.redis_port)
    # redis-server rewrites its title to "redis-server 127.0.0.1:<port>" once started.
    return lambda tokens: (
        any("redis-server" in t for t in tokens) and any(t == port or t.endswith(f":{port}") for t in tokens)
    )


def _tail(path: Path, lines: int = 200) -> list[str]:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            return handle.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _last_problem(*paths: Path) -> str:
    """The most telling line of a failed start: the last ERROR/FATAL/Exception line, else the last line."""
    for path in paths:
        lines = [line.strip() for line in _tail(path) if line.strip()]
        for line in reversed(lines):
            if re.search(r"\b(ERROR|FATAL|Exception|Error:|# )", line):
                return line[:300]
        if lines:
            return lines[-1][:300]
    return "no log output"


# ----------------------------------------------------------------------------------------------------
# Tools: Java, Maven, redis-server


def _infra_file(path: Path) -> Path:
    if not path.exists():
        raise DevStackError(f"{path} not found: the dev stack runs from a source checkout (pip install -e .)")
    return path


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home, "bin", "java") if java_home else None
    java = str(candidate) if candidate is not None and candidate.exists() else shutil.which("java")
    if java is None:
        raise DevStackError(f"java not found: {JAVA_HINT}")
    result = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60, check=False)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if match is None:
        raise DevStackError(f"cannot tell the version of {java}: {JAVA_HINT}")
    major = int(match.group(2) or 0) if match.group(1) == "1" else int(match.group(1))
    if major < MIN_JAVA:
        raise DevStackError(f"java {major} at {java} is too old for Kafka: {JAVA_HINT}")
    return java


def _redis_server() -> str:
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


def kafka_version() -> str:
    """The Kafka version pinned in ``infra/local/pom.xml`` (the jar cache is keyed by it)."""
    match = re.search(r"<kafka\.version>\s*([^<\s]+)\s*</kafka\.version>", _infra_file(POM).read_text())
    if match is None:
        raise DevStackError(f"{POM} does not pin <kafka.version>")
    return match.group(1)


# ----------------------------------------------------------------------------------------------------
# Kafka jars, config, storage


def _fetch_jars(layout: _Layout) -> Path:
    pom_bytes = _infra_file(POM).read_bytes()
    version = kafka_version()
    # The marker holds the pom's digest: a changed pom (say, another logging binding) refetches.
    digest = hashlib.sha256(pom_bytes).hexdigest()[:16]
    libs = layout.libs_root / version
    marker = libs / ".fetched"
    if marker.exists() and marker.read_text().strip() == digest:
        return libs

    mvn = shutil.which("mvn")
    if mvn is None:
        raise DevStackError(f"mvn not found: {MAVEN_HINT}")
    layout.libs_root.mkdir(parents=True, exist_ok=True)
    staging = layout.libs_root / f".{version}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    fetch_log = layout.libs_root / f"fetch-{version}.log"
    started = time.monotonic()
    log.info("devstack.fetch_jars version=%s dest=%s", version, libs)
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(POM),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={staging}",
        "-DincludeScope=runtime",
    ]
    with open(fetch_log, "wb") as out:
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=900, check=False)
    core = staging / f"kafka_2.13-{version}.jar"
    if result.returncode != 0 or not core.exists():
        shutil.rmtree(staging, ignore_errors=True)
        raise DevStackError(
            f"fetching Kafka {version} jars with Maven failed (exit {result.returncode}): "
            f"{_last_problem(fetch_log)} (full output: {fetch_log})"
        )
    (staging / ".fetched").write_text(digest + "\n")
    shutil.rmtree(libs, ignore_errors=True)
    os.replace(staging, libs)
    log.info(
        "devstack.jars_fetched version=%s jars=%d elapsed_s=%.1f",
        version,
        len(list(libs.glob("*.jar"))),
        time.monotonic() - started,
    )
    return libs


def _write_kafka_config(layout: _Layout, settings: Settings) -> Path:
    template = string.Template(_infra_file(SERVER_TEMPLATE).read_text())
    try:
        text = template.substitute(
            kafka_port=layout.kafka_port,
            controller_port=layout.kafka_port + 1,
            log_dirs=layout.kafka_dir / "data",
            num_partitions=settings.topic_partitions,
        )
    except (KeyError, ValueError) as exc:
        raise DevStackError(f"{SERVER_TEMPLATE} has an unknown or malformed placeholder: {exc}") from exc
    layout.kafka_logs.mkdir(parents=True, exist_ok=True)
    layout.kafka_props.write_text(text)
    return layout.kafka_props


def _log_opts(layout: _Layout) -> list[str]:
    return [f"-Dkafka.logs.dir={layout.kafka_logs}", f"-Dlog4j.configuration={_infra_file(LOG4J_CONFIG).as_uri()}"]


def _format_storage(layout: _Layout, java: str, libs: Path) -> None:
    """Format the KRaft metadata log once (``meta.properties`` marks a formatted folder)."""
    if (layout.kafka_dir / "data" / "meta.properties").exists():
        return
    id_file = layout.kafka_dir / "cluster.id"
    cluster_id = id_file.read_text().strip() if id_file.exists() else ""
    if not cluster_id:
        # Kafka's Uuid text form: 16 random bytes, URL-safe base64 without padding.
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
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
        "-t",
        cluster_id,
        "-c",
        str(layout.kafka_props),
        "--ignore-formatted",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        reason = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise DevStackError(f"formatting KRaft storage in {layout.kafka_dir / 'data'} failed: {reason}")
    log.info("devstack.kafka_formatted cluster_id=%s dir=%s", cluster_id, layout.kafka_dir / "data")


def _spawn(cmd: list[str], log_path: Path, cwd: Path, pid_file: Path) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        # A new session: the service outlives the CLI and ignores the terminal's Ctrl-C.
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
    _CHILDREN[proc.pid] = proc
    pid_file.write_text(f"{proc.pid}\n")
    return proc.pid


def kafka_jvm_opts(settings: Settings) -> list[str]:
    """The broker's JVM options: ``KAFKA_JVM_OPTS``, without the C1-only cap when ``kafka_full_jit``."""
    return [o for o in KAFKA_JVM_OPTS if not (settings.kafka_full_jit and o == C1_ONLY)]


def _start_kafka(layout: _Layout, settings: Settings, java: str, libs: Path) -> int:
    _write_kafka_config(layout, settings)
    _format_storage(layout, java, libs)
    cmd = [
        java,
        *kafka_jvm_opts(settings),
        *_log_opts(layout),
        "-cp",
        str(libs / "*"),
        "kafka.Kafka",
        str(layout.kafka_props),
    ]
    pid = _spawn(cmd, layout.kafka_out, layout.kafka_dir, layout.kafka_pid)
    log.info("devstack.kafka_spawned pid=%d bootstrap=%s version=%s", pid, layout.bootstrap, kafka_version())
    return pid


def _start_redis(layout: _Layout, server: str) -> int:
    data = layout.redis_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    cmd = [
        server,
        "--port",
        str(layout.redis_port),
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
    pid = _spawn(cmd, layout.redis_log, layout.redis_dir, layout.redis_pid)
    log.info("devstack.redis_spawned pid=%d url=%s", pid, layout.redis_url)
    return pid


def _busy_port_error(port: int, setting: str) -> DevStackError:
    return DevStackError(f"port {port} is in use by a process this stack did not start: stop it or set {setting}")


# ----------------------------------------------------------------------------------------------------
# Stopping


def _stop_pids(pids: dict[str, tuple[int, Path, Callable[[list[str]], bool]]]) -> None:
    """SIGTERM every service, wait for each (controlled shutdown), SIGKILL what is left."""
    for name, (pid, _, _) in pids.items():
        log.info("devstack.stopping service=%s pid=%d", name, pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for name, (pid, pid_file, owns) in pids.items():
        started = time.monotonic()
        deadline = started + STOP_TIMEOUT_S[name]
        while _alive(pid, owns) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid, owns):
            log.warning("devstack.kill service=%s pid=%d after_s=%.0f", name, pid, STOP_TIMEOUT_S[name])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            child = _CHILDREN.get(pid)
            if child is not None:
                child.wait(timeout=10)
        _CHILDREN.pop(pid, None)
        pid_file.unlink(missing_ok=True)
        log.info("devstack.stopped service=%s pid=%d elapsed_s=%.2f", name, pid, time.monotonic() - started)


# ----------------------------------------------------------------------------------------------------
# Public API


def fetch_jars(settings: Settings | None = None) -> Path:
    """Fetch the pinned Kafka broker jars into ``<state_dir>/kafka/libs/<version>`` unless cached;
    returns that folder. Needs Maven (and network) only the first time."""
    layout = _Layout.of(settings or get_settings())
    with _locked(layout):
        return _fetch_jars(layout)


def up(settings: Settings | None = None) -> StackInfo:
    """Start Kafka and Redis unless they already run, wait until both answer, return their addresses.

    Idempotent: a live process (checked by pid file, command line and port) is reused; a stale pid
    file is removed. Raises ``DevStackError`` with a one-line reason when something is missing or a
    service will not start (the processes this call started are stopped again).
    """
    settings = settings or get_settings()
    layout = _Layout.of(settings)
    started_at = time.monotonic()
    with _locked(layout):
        kafka_owns, redis_owns = _kafka_owner(layout), _redis_owner(layout)
        kafka_pid = _running_pid(layout.kafka_pid, kafka_owns)
        redis_pid = _running_pid(layout.redis_pid, redis_owns)
        started: list[str] = []

        if kafka_pid is None:
            for port in (layout.kafka_port, layout.kafka_port + 1):
                if _port_in_use(port):
                    raise _busy_port_error(port, "SLUICEGATE_KAFKA_PORT")
        if redis_pid is None and _port_in_use(layout.redis_port):
            raise _busy_port_error(layout.redis_port, "SLUICEGATE_REDIS_PORT")

        # Every tool is checked (and the jars fetched) before anything starts, so a missing one fails
        # fast with its own message and leaves nothing running.
        java, libs = (_java(), _fetch_jars(layout)) if kafka_pid is None else ("", layout.libs_root)
        redis_server = _redis_server() if redis_pid is None else ""

        try:
            if redis_pid is None:  # Redis first: it is ready long before the JVM, so nothing waits on it
                redis_pid = _start_redis(layout, redis_server)
                started.append("redis")
            if kafka_pid is None:
                kafka_pid = _start_kafka(layout, settings, java, libs)
                started.append("kafka")
            _run_coro(_wait_ready(layout, kafka_pid, redis_pid))
        except BaseException:
            # Leave nothing half-started behind: a retry then starts from a clean slate.
            ours = {
                "kafka": (kafka_pid, layout.kafka_pid, kafka_owns),
                "redis": (redis_pid, layout.redis_pid, redis_owns),
            }
            _stop_pids(
                {
                    name: (pid, pid_file, owns)
                    for name, (pid, pid_file, owns) in ours.items()
                    if name in started and pid is not None
                }
            )
            raise

    info = StackInfo(
        kafka_bootstrap=layout.bootstrap,
        redis_url=layout.redis_url,
        kafka_pid=kafka_pid,
        redis_pid=redis_pid,
        state_dir=layout.state,
        started=tuple(started),
        elapsed_s=time.monotonic() - started_at,
    )
    log.info(
        "devstack.up bootstrap=%s redis_url=%s kafka_pid=%d redis_pid=%d started=%s elapsed_s=%.2f",
        info.kafka_bootstrap,
        info.redis_url,
        kafka_pid,
        redis_pid,
        ",".join(started) or "none",
        info.elapsed_s,
    )
    return info


async def _wait_ready(layout: _Layout, kafka_pid: int, redis_pid: int) -> None:
    def kafka_check() -> None:
        if not _alive(kafka_pid, _kafka_owner(layout)):
            raise DevStackError(
                f"kafka exited during startup: {_last_problem(layout.kafka_out, layout.kafka_logs / 'server.log')}"
                f" (logs in {layout.kafka_logs})"
            )

    def redis_check() -> None:
        if not _alive(redis_pid, _redis_owner(layout)):
            raise DevStackError(f"redis exited during startup: {_last_problem(layout.redis_log)}")

    try:
        await asyncio.gather(
            wait_for_kafka(layout.bootstrap, KAFKA_START_TIMEOUT_S, check=kafka_check),
            wait_for_redis(layout.redis_url, REDIS_START_TIMEOUT_S, check=redis_check),
        )
    except TimeoutError as exc:
        raise DevStackError(f"{exc} (logs in {layout.state})") from exc


def status(settings: Settings | None = None) -> StackStatus:
    """What runs (by pid file and command line) and whether each address answers a request."""
    layout = _Layout.of(settings or get_settings())
    kafka_pid = _running_pid(layout.kafka_pid, _kafka_owner(layout))
    redis_pid = _running_pid(layout.redis_pid, _redis_owner(layout))

    async def probe() -> tuple[str | None, str | None]:
        async def kafka() -> str | None:
            try:
                cluster = await probe_kafka(layout.bootstrap, timeout_s=3.0)
            except ConnectionError:
                return None
            return f"cluster {cluster.get('cluster_id')}"

        async def redis() -> str | None:
            try:
                return f"redis {await wait_for_redis(layout.redis_url, timeout_s=1.0)}"
            except TimeoutError:
                return None

        return await asyncio.gather(kafka(), redis())

    kafka_detail, redis_detail = _run_coro(probe())
    return StackStatus(
        kafka=ServiceStatus(
            "kafka",
            layout.bootstrap,
            kafka_pid,
            kafka_detail is not None,
            layout.kafka_logs / "server.log",
            kafka_detail or "",
        ),
        redis=ServiceStatus(
            "redis", layout.redis_url, redis_pid, redis_detail is not None, layout.redis_log, redis_detail or ""
        ),
    )


def down(settings: Settings | None = None, services: tuple[str, ...] = ("kafka", "redis")) -> None:
    """Stop Kafka and Redis (SIGTERM, wait, then SIGKILL) and remove their pid files. Data is kept.

    ``services`` limits the stop to some of them (a test session stops only what it started).
    """
    unknown = set(services) - {"kafka", "redis"}
    if unknown:
        raise DevStackError(f"unknown services {sorted(unknown)}: expected kafka and/or redis")
    layout = _Layout.of(settings or get_settings())
    with _locked(layout):
        pids: dict[str, tuple[int, Path, Callable[[list[str]], bool]]] = {}
        for name, pid_file, owns in (
            ("kafka", layout.kafka_pid, _kafka_owner(layout)),
            ("redis", layout.redis_pid, _redis_owner(layout)),
        ):
            if name not in services:
                continue
            pid = _running_pid(pid_file, owns)
            if pid is None:
                log.info("devstack.not_running service=%s", name)
            else:
                pids[name] = (pid, pid_file, owns)
        _stop_pids(pids)


def main(argv: list[str] | None = None) -> int:
    """``python -m sluicegate.stack.devstack fetch|up|status|down`` (CI and scripts; users have the CLI)."""
    parser = argparse.ArgumentParser(prog="python -m sluicegate.stack.devstack", description=main.__doc__)
    parser.add_argument("command", choices=["fetch", "up", "status", "down"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    settings = get_settings()
    try:
        if args.command == "fetch":
            print(fetch_jars(settings))
        elif args.command == "up":
            print("\n".join(up(settings).lines()))
        elif args.command == "status":
            result = status(settings)
            print("\n".join(result.lines()))
            return 0 if result.healthy else 3
        else:
            down(settings)
    except DevStackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
