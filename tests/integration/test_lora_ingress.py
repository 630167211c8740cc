"""LoRA adapters through ingress with the official ``openai`` SDK, on real Kafka and Redis: load and unload
(vLLM's endpoints, admin keys only, verified by a live worker's check loop), adapters as model names in
``/v1/models`` and in chat, completions, embeddings and the native API (the request keeps the base model's topic
and carries ``adapter``), private adapters unknown to other tenants, and the refusals in OpenAI's shape. The
router part sends Kafka-native records naming adapters through ``llm.inbound``.

The check loop here is ``serve_checks`` with the stand-in verify of :mod:`lora_support` (the worker wires the
engine's ``check_adapter`` into the same loop); the fake worker answers the requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import openai
import pytest
from batch_support import ResultsWorker, batch_worker, chat_line, jsonl, wait_status
from ingress_support import MODEL, FakeWorker, consume, heartbeat, reader, running_ingress
from lora_support import config_checker, write_adapter
from openai import AsyncOpenAI
from redis.asyncio import Redis

from router.stream import run_router
from schemas import BatchOutputLine, DeadLetter, InferenceRequest, Names
from sluicegate.kafka import create_producer, ensure_topics
from sluicegate.lora.checks import serve_checks
from sluicegate.settings import Settings
from sluicegate.task_stop import cancel_and_wait

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ADMIN_KEY = "sk-lora-admin-key"
ACME_KEY = "sk-lora-acme-key"
OTHER_KEY = "sk-lora-other-key"


@pytest.fixture
def settings(test_settings: Settings, tmp_path: Path) -> Settings:
    keys = tmp_path / "keys.jsonl"
    keys.write_text(
        "\n".join(
            json.dumps(entry)
            for entry in (
                {"key": ADMIN_KEY, "tenant": "ops", "admin": True},
                {"key": ACME_KEY, "tenant": "acme"},
                {"key": OTHER_KEY, "tenant": "other"},
            )
        )
    )
    return test_settings.model_copy(
        update={
            "api_keys_file": keys,
            "stream_token_secret": "lora-secret",
            "topic_partitions": 1,
            "heartbeat_interval_s": 60.0,
            "lora_check_timeout_s": 5.0,
            "state_dir": tmp_path / "state",
            "files_url": str(tmp_path / "files"),
            "batch_tick_s": 0.3,
            "lora_cache_ttl_s": 30.0,  # long: what a test sees after its own load/unload is the invalidation's doing
        }
    )


@pytest.fixture
async def ingress(settings: Settings, redis: Redis, cleanup_topics: None) -> AsyncIterator[str]:
    await heartbeat(redis, Names(settings.topic_prefix), lora=True)
    async with running_ingress(settings) as url:
        yield url


@pytest.fixture
async def checker(settings: Settings, redis: Redis) -> AsyncIterator[None]:
    """A live worker's adapter-check loop for the model."""
    task = asyncio.create_task(serve_checks(redis, settings.topic_prefix, MODEL, config_checker(MODEL)))
    yield
    await cancel_and_wait(task)


def client(url: str, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def load(api: AsyncOpenAI, **body: object) -> httpx.Response:
    return await api.post("/load_lora_adapter", body=body, cast_to=httpx.Response)


async def unload(api: AsyncOpenAI, **body: object) -> httpx.Response:
    return await api.post("/unload_lora_adapter", body=body, cast_to=httpx.Response)


async def test_load_list_use_and_unload(
    ingress: str, settings: Settings, redis: Redis, checker: None, tmp_path: Path
) -> None:
    admin, acme = client(ingress, ADMIN_KEY), client(ingress, ACME_KEY)
    path = write_adapter(tmp_path, "sql", rank=4, base=MODEL)
    async with FakeWorker(settings, redis) as worker:
        loaded = await load(admin, lora_name="sql-lora", lora_path=str(path))  # base: the one served model
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'sql-lora' added successfully.")

        cards = {m.id: m for m in (await acme.models.list()).data}
        assert set(cards) == {MODEL, "sql-lora"}
        card = cards["sql-lora"].model_dump()
        assert card["parent"] == MODEL and card["root"] == str(path) and card["object"] == "model"
        assert (await acme.models.retrieve("sql-lora")).model_dump()["parent"] == MODEL

        chat = await acme.chat.completions.create(
            model="sql-lora", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert chat.model == "sql-lora" and chat.choices[0].message.content == "You said: hi"
        text = await acme.completions.create(model="sql-lora", prompt="select", max_tokens=8)
        assert text.model == "sql-lora"
        vectors = await acme.embeddings.create(model="sql-lora", input="embed me")
        assert vectors.model == "sql-lora" and len(vectors.data) == 1
        plain = await acme.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "base"}])
        assert plain.model == MODEL
        async with httpx.AsyncClient(base_url=ingress, headers={"x-api-key": ACME_KEY}) as http:
            native = await http.post("/v1/requests", json={"model": "sql-lora", "prompt": "native"})
            # An adapter does not change the tokenizer: its name tokenizes as its base model does.
            counted = [
                (await http.post("/tokenize", json={"model": name, "prompt": "count these words"})).json()
                for name in ("sql-lora", MODEL)
            ]
        assert native.status_code == 202 and native.json()["model"] == "sql-lora"
        assert counted[0] == counted[1] and counted[0]["count"] > 0
        await _until(lambda: len(worker.seen) == 5)
        seen = [(request.model, request.adapter) for _, request in worker.seen]
        # Every adapter request went to the base model's topic and names the adapter; the base request none.
        assert seen == [(MODEL, "sql-lora")] * 3 + [(MODEL, None), (MODEL, "sql-lora")]
        assert {record.topic for record, _ in worker.seen} <= set(Names(settings.topic_prefix).request_topics(MODEL))

        removed = await unload(admin, lora_name="sql-lora")
        assert (removed.status_code, removed.text) == (200, "Success: LoRA adapter 'sql-lora' removed successfully.")
        with pytest.raises(openai.NotFoundError) as gone:
            await acme.chat.completions.create(model="sql-lora", messages=[{"role": "user", "content": "hi"}])
        assert gone.value.body["code"] == "model_not_found"  # type: ignore[index]
        assert "sql-lora" not in {m.id for m in (await acme.models.list()).data}
        with pytest.raises(openai.NotFoundError, match="cannot be found"):
            await unload(admin, lora_name="sql-lora")
        with pytest.raises(openai.BadRequestError) as nameless:  # a check of the whole body: no field to name
            await unload(admin)
        assert nameless.value.body["param"] is None  # type: ignore[index]
        assert nameless.value.body["message"].startswith("give 'lora_name'"), nameless.value.body  # type: ignore[index]
    await asyncio.gather(admin.close(), acme.close())


async def test_private_adapter_is_unknown_to_other_tenants(
    ingress: str, settings: Settings, redis: Redis, checker: None, tmp_path: Path
) -> None:
    admin, acme, other = client(ingress, ADMIN_KEY), client(ingress, ACME_KEY), client(ingress, OTHER_KEY)
    path = write_adapter(tmp_path, "acme", base=MODEL)
    async with FakeWorker(settings, redis):
        loaded = await load(admin, lora_name="acme-only", lora_path=str(path), base_model=MODEL, tenant="acme")
        assert loaded.status_code == 200
        assert "acme-only" in {m.id for m in (await acme.models.list()).data}
        assert {m.id for m in (await other.models.list()).data} == {MODEL}
        answer = await acme.chat.completions.create(model="acme-only", messages=[{"role": "user", "content": "x"}])
        assert answer.model == "acme-only"
        with pytest.raises(openai.NotFoundError) as hidden:
            await other.chat.completions.create(model="acme-only", messages=[{"role": "user", "content": "x"}])
        # Exactly what a name nobody registered gets: nothing tells the other tenant the adapter exists.
        with pytest.raises(openai.NotFoundError) as unknown:
            await other.chat.completions.create(model="no-such-name", messages=[{"role": "user", "content": "x"}])
        expected = dict(unknown.value.body)  # type: ignore[call-overload]
        expected["message"] = expected["message"].replace("no-such-name", "acme-only")
        assert hidden.value.body == expected
        assert hidden.value.body["code"] == "model_not_found"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            await other.models.retrieve("acme-only")
    await asyncio.gather(admin.close(), acme.close(), other.close())


async def test_load_refusals_in_openai_shape(
    ingress: str, settings: Settings, redis: Redis, checker: None, tmp_path: Path
) -> None:
    admin, acme = client(ingress, ADMIN_KEY), client(ingress, ACME_KEY)
    good = write_adapter(tmp_path, "good", base=MODEL)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await load(acme, lora_name="x", lora_path=str(good))
    assert denied.value.body["code"] == "admin_key_required"  # type: ignore[index]
    with pytest.raises(openai.PermissionDeniedError):
        await unload(acme, lora_name="x")
    with pytest.raises(openai.AuthenticationError):
        await load(client(ingress, "sk-not-a-key"), lora_name="x", lora_path=str(good))

    assert (await load(admin, lora_name="dup", lora_path=str(good))).status_code == 200
    with pytest.raises(openai.ConflictError) as duplicate:
        await load(admin, lora_name="dup", lora_path=str(good))
    assert duplicate.value.body["code"] == "adapter_exists"  # type: ignore[index]

    wrong_base = write_adapter(tmp_path, "wrong", base="some-other-model")
    with pytest.raises(openai.BadRequestError) as refused:
        await load(admin, lora_name="wrong", lora_path=str(wrong_base))
    reason = refused.value.body["message"]  # type: ignore[index]
    assert "some-other-model" in reason and "\n" not in reason
    assert refused.value.body["code"] == "invalid_lora_adapter"  # type: ignore[index]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text("{nope")
    with pytest.raises(openai.BadRequestError, match="not JSON"):
        await load(admin, lora_name="corrupt", lora_path=str(corrupt))
    with pytest.raises(openai.NotFoundError) as no_base:
        await load(admin, lora_name="x", lora_path=str(good), base_model="unserved")
    assert no_base.value.body["param"] == "base_model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="already a model name"):
        await load(admin, lora_name=MODEL, lora_path=str(good))
    with pytest.raises(openai.BadRequestError) as missing:
        await load(admin, lora_name="nopath")
    assert missing.value.body["param"] == "lora_path"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        await load(admin, lora_name="bad name", lora_path=str(good))
    # Nothing refused was registered.
    assert {m.id for m in (await acme.models.list()).data} == {MODEL, "dup"}
    await asyncio.gather(admin.close(), acme.close())


async def test_no_worker_to_verify_is_a_503(ingress: str, settings: Settings, tmp_path: Path) -> None:
    admin = client(ingress, ADMIN_KEY)
    with pytest.raises(openai.InternalServerError) as unavailable:
        await load(admin, lora_name="lonely", lora_path=str(write_adapter(tmp_path, "lonely", base=MODEL)))
    assert unavailable.value.status_code == 503
    assert "no worker of model" in unavailable.value.body["message"]  # type: ignore[index]
    assert unavailable.value.response.headers["retry-after"]
    with pytest.raises(openai.NotFoundError):
        await admin.models.retrieve("lonely")
    await admin.close()


async def test_a_model_whose_workers_have_lora_off_refuses_at_once_saying_how(
    ingress: str, settings: Settings, redis: Redis, tmp_path: Path
) -> None:
    """The model's one live worker serves no adapters (``sluicegate up``'s default): the load is a 400 that says how
    to turn LoRA on, at once (it waited for a check nobody takes, then a 503 that did not say why)."""
    await heartbeat(redis, Names(settings.topic_prefix), lora=False)
    admin = client(ingress, ADMIN_KEY)
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        await load(admin, lora_name="nope", lora_path=str(write_adapter(tmp_path, "nope", base=MODEL)))
    assert time.monotonic() - started < settings.lora_check_timeout_s  # not the check's timeout
    assert refused.value.code == "lora_not_enabled" and "SLUICEGATE_ENABLE_LORA=true" in refused.value.message
    with pytest.raises(openai.NotFoundError):
        await admin.models.retrieve("nope")
    await admin.close()


async def test_router_resolves_kafka_native_records_naming_adapters(
    ingress: str, settings: Settings, redis: Redis, checker: None, tmp_path: Path
) -> None:
    names = Names(settings.topic_prefix)
    admin = client(ingress, ADMIN_KEY)
    assert (await load(admin, lora_name="sql", lora_path=str(write_adapter(tmp_path, "sql", base=MODEL)))).is_success
    private = write_adapter(tmp_path, "mine", base=MODEL)
    assert (await load(admin, lora_name="mine", lora_path=str(private), tenant="acme")).is_success
    await admin.close()
    records = [
        InferenceRequest(request_id="by-name", model="sql", prompt="a"),
        InferenceRequest(request_id="by-field", model=MODEL, adapter="sql", prompt="b"),
        InferenceRequest(request_id="private-ok", model="mine", prompt="c", tenant="acme"),
        InferenceRequest(request_id="private-no", model="mine", prompt="d", tenant="other"),
        InferenceRequest(request_id="ghost", model=MODEL, adapter="ghost", prompt="e"),
        InferenceRequest(request_id="wrong-base", model="other-model", adapter="sql", prompt="f"),
    ]
    stop = asyncio.Event()
    task = asyncio.create_task(run_router(settings, stop=stop))
    producer = create_producer(settings)
    await producer.start()
    try:
        await ensure_topics(settings.kafka_bootstrap, {names.inbound_topic: 1}, 1)
        for record in records:
            await producer.send_and_wait(names.inbound_topic, record.model_dump_json().encode())
        async with (
            reader(settings, names.request_topic(MODEL, "standard"), partitions=1) as routed_reader,
            reader(settings, names.dlq_topic, partitions=1) as dlq_reader,
        ):
            routed = await consume(routed_reader, 3, timeout_s=30)
            letters = await consume(dlq_reader, 3, timeout_s=30)
    finally:
        await producer.stop()
        stop.set()
        await asyncio.wait_for(task, 15)
    got = {r.request_id: (r.model, r.adapter) for r in (InferenceRequest.model_validate_json(x.value) for x in routed)}
    assert got == {"by-name": (MODEL, "sql"), "by-field": (MODEL, "sql"), "private-ok": (MODEL, "mine")}
    dead = {DeadLetter.model_validate_json(r.value).request_id: dict(r.headers)["reason"].decode() for r in letters}
    assert dead == {"private-no": "unknown_model", "ghost": "unknown_model", "wrong-base": "invalid_adapter"}


async def test_batch_lines_naming_adapters(
    ingress: str, settings: Settings, redis: Redis, checker: None, tmp_path: Path
) -> None:
    admin, acme = client(ingress, ADMIN_KEY), client(ingress, ACME_KEY)
    assert (await load(admin, lora_name="sql", lora_path=str(write_adapter(tmp_path, "sql", base=MODEL)))).is_success
    theirs = write_adapter(tmp_path, "theirs", base=MODEL)
    assert (await load(admin, lora_name="theirs", lora_path=str(theirs), tenant="other")).is_success
    lines = [
        chat_line("adapter", "hi", model="sql"),
        chat_line("base", "ho"),
        chat_line("not-mine", "hu", model="theirs"),
    ]
    async with ResultsWorker(settings, redis) as worker:
        with batch_worker(settings, tmp_path / "batch-worker.log"):
            uploaded = await acme.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            batch = await acme.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            done = await wait_status(acme, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert {(r.model, r.adapter) for _, r in worker.seen} == {(MODEL, None), (MODEL, "sql")}
    assert len(worker.seen) == 2
    assert done.output_file_id is not None and done.error_file_id is not None
    output = [
        BatchOutputLine.model_validate_json(x)
        for x in (await acme.files.content(done.output_file_id)).text.splitlines()
    ]
    models = {line.custom_id: line.response.body["model"] for line in output if line.response is not None}
    assert models == {"adapter": "sql", "base": MODEL}
    (refused,) = [
        BatchOutputLine.model_validate_json(x) for x in (await acme.files.content(done.error_file_id)).text.splitlines()
    ]
    assert refused.custom_id == "not-mine" and refused.response is not None
    assert (refused.response.status_code, refused.response.body["error"]["code"]) == (404, "model_not_found")
    await asyncio.gather(admin.close(), acme.close())


async def _until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
