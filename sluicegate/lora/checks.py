"""Load-time verification of a LoRA adapter by a live worker of its base model, request-reply over Redis lists.

Ingress has no model and must not import the engine, yet a registration is only accepted once the files were
read against the real base model (a corrupt adapter, or one whose target modules or base do not match,
is refused at load with a one-line reason). So :func:`ask_check` pushes an :class:`AdapterCheck` onto the base
model's list (``Names.lora_checks_key``) and waits on a list of its own (``Names.lora_verdict_key``) for the
:class:`CheckVerdict` that :func:`serve_checks`, running in every worker, pushes back after calling its
``verify`` function (the engine's ``check_adapter``). Any one worker answers; a check its asker gave up on
(past its ``deadline``) is dropped unanswered. Both keys carry TTLs, so nothing lingers when nobody answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas import Names

log = logging.getLogger(__name__)

#: Longest single BLPOP: every client's socket timeout (ingress 10 s, router 5 s) is well above it.
_BLOCK_S = 1.0
#: How long an unread verdict, or a checks list nobody pops, is kept after the asker's deadline.
_LINGER_S = 60


class CheckVerdict(BaseModel):
    """A worker's answer: ok, or the one-line reason it refused; the adapter's rank when it read it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ok: bool
    reason: str | None = None
    rank: int | None = Field(None, ge=1)


class AdapterCheck(BaseModel):
    """One check on the wire: which files to verify against which base model, and until when anyone waits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    check_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    base_model: str = Field(min_length=1)
    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    deadline: float = Field(description="time.time() after which the asker no longer waits.")


class NoCheckerError(TimeoutError):
    """No worker of the base model answered the check in time (HTTP 503: none is running, or all are busy)."""


Verify = Callable[[str, str], Awaitable[CheckVerdict]]


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500] or "refused"


async def ask_check(
    redis: Redis,
    prefix: str,
    base_model: str,
    name: str,
    path: str,
    timeout: float,  # noqa: ASYNC109 - the fixed interface; the wait is chunked BLPOPs, not one awaitable
) -> CheckVerdict:
    """Have a live worker of ``base_model`` verify adapter ``name`` at ``path``; :class:`NoCheckerError` when none
    answers within ``timeout`` seconds."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    names = Names(prefix)
    check = AdapterCheck(
        check_id=uuid.uuid4().hex, base_model=base_model, name=name, path=path, deadline=time.time() + timeout
    )
    checks_key, verdict_key = names.lora_checks_key(base_model), names.lora_verdict_key(check.check_id)
    payload = check.model_dump_json()
    async with redis.pipeline(transaction=False) as pipe:
        pipe.rpush(checks_key, payload)
        pipe.expire(checks_key, int(timeout) + _LINGER_S)
        await pipe.execute()
    end = time.monotonic() + timeout
    try:
        while (left := end - time.monotonic()) > 0:
            # Short BLPOPs: no client's socket timeout is ever reached, whatever ``timeout`` is.
            popped = await redis.blpop([verdict_key], timeout=min(_BLOCK_S, max(left, 0.01)))
            if popped is not None:
                return CheckVerdict.model_validate_json(popped[1])
    finally:
        if time.monotonic() >= end:
            # Nobody took it: withdraw it so a worker started later does not verify for no one.
            try:
                await redis.lrem(checks_key, 1, payload)
            except RedisError:
                pass  # the deadline in the check makes a worker drop it anyway
    raise NoCheckerError(f"no worker of model '{base_model}' answered the adapter check within {timeout:g}s")


async def _answer(redis: Redis, names: Names, raw: bytes, verify: Verify) -> None:
    try:
        check = AdapterCheck.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("lora.check.bad_message error=%s", exc)
        return
    if time.time() >= check.deadline:
        log.info("lora.check.expired check_id=%s name=%s", check.check_id, check.name)
        return
    try:
        verdict = await verify(check.name, check.path)
    except Exception as exc:  # a verifier bug or unreadable path is a refusal with its reason, not a dead loop
        log.warning("lora.check.verify_failed name=%s path=%s error=%r", check.name, check.path, exc)
        verdict = CheckVerdict(ok=False, reason=_one_line(str(exc) or type(exc).__name__))
    if not verdict.ok:
        verdict = verdict.model_copy(update={"reason": _one_line(verdict.reason or "refused")})
    key = names.lora_verdict_key(check.check_id)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.rpush(key, verdict.model_dump_json())
        pipe.expire(key, _LINGER_S)
        await pipe.execute()
    log.info("lora.check.answered name=%s ok=%s reason=%s", check.name, verdict.ok, verdict.reason)


async def serve_checks(redis: Redis, prefix: str, base_model: str, verify: Verify) -> None:
    """Answer ``base_model``'s adapter checks until cancelled (run it in a task); Redis outages are waited out."""
    names = Names(prefix)
    key = names.lora_checks_key(base_model)
    backoff = 0.1
    while True:
        try:
            popped = await redis.blpop([key], timeout=_BLOCK_S)
            backoff = 0.1
        except RedisError as exc:
            log.warning("lora.check.redis_error key=%s error=%s", key, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            continue
        if popped is None:
            continue
        try:
            await _answer(redis, names, popped[1], verify)
        except RedisError as exc:
            # The verdict could not be written: the asker times out with a 503 and may retry.
            log.warning("lora.check.reply_failed error=%s", exc)
