"""The Celery app of the batch workers: the Redis broker we already run, late acks with re-delivery of a dead
worker's task after a short visibility timeout, and the beat schedule (one ``tick`` every ``batch_tick_s``).

Every task is idempotent and takes a per-batch Redis lock, so a task delivered twice (a worker killed before its
ack, two beats) does nothing twice. Queue and broker keys carry the topic prefix, so deployments sharing a Redis
(and tests) stay apart.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from celery import Celery

from schemas import Names
from sluicegate.redis_urls import is_sentinel_url, parse_sentinel_url, tls_options
from sluicegate.settings import BatchApiSettings, BatchServiceSettings, RedisSettings

TICK_TASK = "sluicegate.batch.tick"
ADVANCE_TASK = "sluicegate.batch.advance"


def broker_url(settings: BatchApiSettings) -> str:
    """The broker: ``batch_broker_url``, else the Redis everything else uses."""
    return settings.batch_broker_url or settings.redis_url


class KombuBroker(NamedTuple):
    """What kombu needs to reach the broker as the pipeline's own clients reach Redis."""

    url: str
    transport_options: dict[str, Any]
    use_ssl: dict[str, Any] | None


def kombu_broker(url: str, settings: RedisSettings | None = None) -> KombuBroker:
    """kombu's form of a pipeline Redis URL (:mod:`sluicegate.redis_urls`). A ``redis+sentinel://h:p,h:p/service/db``
    URL becomes kombu's ``sentinel://h:p/db;sentinel://h:p/db`` with ``master_name`` = service, so the broker
    follows a failover like every other Redis client of the pipeline; the ACL user and password go to the primary,
    ``sentinel_username``/``sentinel_password`` to the Sentinels. A TLS URL (``rediss://``, ``rediss+sentinel://``)
    checks the server's certificate (``broker_use_ssl`` with ``ssl_cert_reqs`` required unless the URL says otherwise,
    the CA from the URL or ``redis_tls_ca_file``): left to itself kombu would connect to a ``rediss://`` URL without
    ``ssl_cert_reqs`` unchecked."""
    tls = tls_options(url, settings)
    if not is_sentinel_url(url):
        parts = urlsplit(url)
        # The TLS parameters travel in broker_use_ssl; in the URL kombu would take them as its own.
        kept = [(k, v) for k, v in parse_qsl(parts.query) if not k.startswith("ssl_")]
        plain = urlunsplit(parts._replace(query=urlencode(kept)))
        return KombuBroker(plain, {}, tls.kombu() if tls else None)
    target = parse_sentinel_url(url, settings)
    auth = ""
    if target.username or target.password:
        auth = f"{quote(target.username or '', safe='')}:{quote(target.password or '', safe='')}@"
    hosts = ";".join(f"sentinel://{auth}{host}:{port}/{target.db}" for host, port in target.sentinels)
    sentinel_kwargs: dict[str, Any] = {
        k: v for k, v in (("username", target.sentinel_username), ("password", target.sentinel_password)) if v
    }
    if target.tls:
        sentinel_kwargs.update(ssl=True, **target.tls.redis_py())
    options: dict[str, Any] = {"master_name": target.service}
    if sentinel_kwargs:
        options["sentinel_kwargs"] = sentinel_kwargs
    return KombuBroker(hosts, options, target.tls.kombu() if target.tls else None)


def make_app(settings: BatchServiceSettings) -> Celery:
    """The batch workers' Celery app configured from ``settings``, with the beat's schedule (tasks are registered
    by :mod:`batch_service.tasks`)."""
    names = settings.names
    app = _app(broker_url(settings), settings.topic_prefix, settings.batch_visibility_timeout_s)
    app.conf.update(
        beat_schedule={
            "batch-tick": {
                "task": TICK_TASK,
                "schedule": settings.batch_tick_s,
                # A tick that waited longer than an interval is stale: the next one does the same work.
                "options": {"expires": max(settings.batch_tick_s * 2, 1.0)},
            }
        },
        beat_schedule_filename=str((settings.state_dir / f"celerybeat-{names.prefix or 'default'}").resolve()),
    )
    return app


def _app(url: str, prefix: str, visibility_timeout_s: int) -> Celery:
    """A Celery app on the broker at ``url``, its queue and keys under ``prefix``: what the batch workers'
    app and a sender's (:func:`kick`) share."""
    names = Names(prefix)
    broker = kombu_broker(url)
    app = Celery("sluicegate-batch", broker=broker.url)
    app.conf.update(
        broker_use_ssl=broker.use_ssl,
        task_default_queue=names.batch_queue,
        # A task is acked when it ends, not when it starts, and a worker lost mid-task (kill -9) gives it back:
        # the broker re-delivers it after the visibility timeout, kept short so a batch stalls seconds, not an hour.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={
            "visibility_timeout": visibility_timeout_s,
            "global_keyprefix": names.prefix,
            **broker.transport_options,
        },
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
        result_backend=None,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    return app


# A sender only sends: it needs no beat, and it reads nothing but what the caller's settings carry (ingress has no
# batch-worker settings to build a whole worker app from).
_sender = lru_cache(maxsize=4)(_app)


def kick(settings: BatchApiSettings, batch_id: str) -> None:
    """Ask a batch worker to advance ``batch_id`` now (blocking: run it off the event loop)."""
    app = _sender(broker_url(settings), settings.topic_prefix, settings.batch_visibility_timeout_s)
    app.send_task(ADVANCE_TASK, args=[batch_id], queue=settings.names.batch_queue, expires=60)
