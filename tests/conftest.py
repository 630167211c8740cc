"""Fixtures shared by every test: where Kafka and Redis are, and per-test names.

Kafka and Redis come, in order, from addresses in the environment (``SLUICEGATE_TEST_KAFKA_BOOTSTRAP``,
``SLUICEGATE_TEST_REDIS_URL``), from testcontainers when a Docker daemon answers, or from the local dev
stack (``cli.backbone.devstack``) on test ports, sharing the repository's ``.sluicegate`` jar cache.
They are lazy: a test that asks for neither never starts anything (except under pytest-xdist, whose controller
starts them once for all its workers).
"""

from __future__ import annotations

import os

# One torch (OpenMP) thread per process: the suite runs on two pytest-xdist workers beside the workers, engines
# and brokers it starts, and a process whose OpenMP threads outnumber the free cores spins at every barrier - on
# the 2-core CI machine a worker's engine under a busy neighbour made 6 tokens a second with two threads, 80 with
# one. Children (services, engine processes) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

# Triton fixes its language helpers at first import, so interpreter mode (the Triton kernels run on
# CPU tensors) must be chosen before anything imports the engine. On a GPU the kernels compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests compare streams with their references delta by delta, so workers they start send every engine step's
# token as its own event; the default interval's coalescing has tests of its own (test_worker_stream_interval.py).
os.environ.setdefault("SLUICEGATE_STREAM_INTERVAL_MS", "0")

import contextlib
import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sluicegate.settings import Settings

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

log = logging.getLogger("tests.backbone")

# tests/needs.py: what a test needs is a skip on a developer's machine and a failure under CI=true.
# tests/secure_kafka.py: the session's SASL_SSL broker (fixture ``secure_kafka``); tests/secure_redis.py: its
# TLS-only Redis with per-service ACL users (fixture ``secure_redis_server``).
pytest_plugins = ("needs", "hang_report", "alone", "secure_kafka", "secure_redis")

REPO_ROOT = Path(__file__).resolve().parent.parent
# Not the defaults (9092/6379): a developer's own `sluicegate dev up` stack stays untouched.
TEST_KAFKA_PORT = 19092
TEST_REDIS_PORT = 16379


def _docker_answers() -> bool:
    """A quick ping of the Docker daemon; any failure means no Docker."""
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=2)
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


class Backbone:
    """Provides Kafka and Redis on first use and tears down only what it started."""

    def __init__(self) -> None:
        self._kafka: str | None = os.environ.get("SLUICEGATE_TEST_KAFKA_BOOTSTRAP") or None
        self._redis: str | None = os.environ.get("SLUICEGATE_TEST_REDIS_URL") or None
        self._docker: bool | None = None
        self._cleanups: list[Callable[[], None]] = []

    def _use_docker(self) -> bool:
        if self._docker is None:
            self._docker = _docker_answers()
        return self._docker

    def kafka(self) -> str:
        if self._kafka is None:
            if self._use_docker():
                self._kafka = self._kafka_container()
            else:
                self._local_stack()
        assert self._kafka is not None
        return self._kafka

    def redis(self) -> str:
        if self._redis is None:
            if self._use_docker():
                self._redis = self._redis_container()
            else:
                self._local_stack()
        assert self._redis is not None
        return self._redis

    def _kafka_container(self) -> str:
        try:
            from testcontainers.community.kafka import KafkaContainer
        except ImportError:  # testcontainers < 4.10 keeps the module at the top level
            from testcontainers.kafka import KafkaContainer

        container = KafkaContainer().with_kraft().start()
        self._cleanups.append(container.stop)
        return str(container.get_bootstrap_server())

    def _redis_container(self) -> str:
        try:
            from testcontainers.community.redis import RedisContainer
        except ImportError:
            from testcontainers.redis import RedisContainer

        container = RedisContainer("redis:7").start()
        self._cleanups.append(container.stop)
        return f"redis://{container.get_container_host_ip()}:{container.get_exposed_port(6379)}/0"

    def _local_stack(self) -> None:
        from cli.backbone import devstack

        settings = Settings(state_dir=REPO_ROOT / ".sluicegate", kafka_port=TEST_KAFKA_PORT, redis_port=TEST_REDIS_PORT)
        info = devstack.up(settings)
        log.info(
            "tests.local_stack bootstrap=%s redis_url=%s started=%s",
            info.kafka_bootstrap,
            info.redis_url,
            ",".join(info.started) or "none",
        )
        if info.started:
            self._cleanups.append(lambda: devstack.down(settings, services=info.started))
        # One call brings up both; an address from the environment still wins.
        self._kafka = self._kafka or info.kafka_bootstrap
        self._redis = self._redis or info.redis_url

    def close(self) -> None:
        while self._cleanups:
            cleanup = self._cleanups.pop()
            with contextlib.suppress(Exception):
                cleanup()


_CONTROLLER_BACKBONE = pytest.StashKey[Backbone]()


def _xdist_controller(config: pytest.Config) -> bool:
    """True in the pytest-xdist controller of a parallel run (``-n N``, N > 0); False in its workers and
    in a plain run."""
    return bool(getattr(config.option, "numprocesses", 0)) and not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist the controller brings Kafka and Redis up once, before its workers start, and hands
    them the addresses through the environment they inherit: each worker starting (and, when done, stopping)
    the one local stack on the test ports would pull it from under the others."""
    if _xdist_controller(config):
        provider = Backbone()
        os.environ["SLUICEGATE_TEST_KAFKA_BOOTSTRAP"] = provider.kafka()
        os.environ["SLUICEGATE_TEST_REDIS_URL"] = provider.redis()
        config.stash[_CONTROLLER_BACKBONE] = provider


def pytest_unconfigure(config: pytest.Config) -> None:
    provider = config.stash.get(_CONTROLLER_BACKBONE, None)
    if provider is not None:
        provider.close()


@pytest.fixture(autouse=True)
def _torch_seed() -> None:
    """Every test starts from the same torch RNG state: which tests ran before it on its pytest-xdist worker
    changes from run to run, and a test whose unseeded draws once met a tolerance one seed in 60 missed failed
    CI only now and then. Seeded, a test passes or fails the same way every run, and a failure replays alone."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _recursion_limit() -> Iterator[None]:
    """Put back the interpreter's recursion limit: Inductor raises it to 2000 for good on its first compile, and a
    later test on the same pytest-xdist worker that sends JSON nested 1100 deep to an in-process service (which
    must refuse it by name) then saw it parsed."""
    limit = sys.getrecursionlimit()
    yield
    sys.setrecursionlimit(limit)


@pytest.fixture(autouse=True)
def _logging_state() -> Iterator[None]:
    """Undo what a test leaves in the logging tree: a service run in-process calls ``configure_logging``, which
    installs its own root handler and quiets aiokafka to WARNING for the rest of the worker's life, so a later test
    that read aiokafka's lines from ``caplog`` passed or failed by which tests shared its pytest-xdist worker.
    pytest installs fresh capture handlers for every phase, so only handlers of other origin are removed."""
    root = logging.getLogger()
    handlers, level = set(root.handlers), root.level
    loggers = logging.Logger.manager.loggerDict
    levels = {name: log.level for name, log in loggers.items() if isinstance(log, logging.Logger)}
    yield
    for handler in root.handlers[:]:
        if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
    root.setLevel(level)
    for name, log in list(loggers.items()):
        if isinstance(log, logging.Logger):
            log.setLevel(levels.get(name, logging.NOTSET))


@pytest.fixture(scope="session")
def backbone() -> Iterator[Backbone]:
    """The session's Kafka/Redis provider; starts nothing until an address is asked for."""
    provider = Backbone()
    yield provider
    provider.close()


@pytest.fixture(scope="session")
def kafka_bootstrap(backbone: Backbone) -> str:
    """Bootstrap address of a real Kafka broker for this test session."""
    return backbone.kafka()


@pytest.fixture(scope="session")
def redis_url(backbone: Backbone) -> str:
    """URL of a real Redis server for this test session."""
    return backbone.redis()


@pytest.fixture
def unique_prefix() -> str:
    """A prefix for this test's topics and keys (``t<8 hex>.``), so tests never share state."""
    return f"t{uuid.uuid4().hex[:8]}."


@pytest.fixture
def test_settings(kafka_bootstrap: str, redis_url: str, unique_prefix: str) -> Settings:
    """Settings pointing at the session's Kafka and Redis, with this test's topic/key prefix."""
    return Settings(kafka_bootstrap=kafka_bootstrap, redis_url=redis_url, topic_prefix=unique_prefix)
