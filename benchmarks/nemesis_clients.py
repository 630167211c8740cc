"""The nemesis run's clients, one of each kind a request can come from, each recording what it received:

* ``openai_sse``: a streamed completion through the ``openai`` SDK (ingress follows the stream itself);
* ``websocket``: a native request relayed by the result service's WebSocket, dropped after a few events and
  resumed with ``last_id`` until its end (every ``seq`` it received is kept);
* ``native``: ``POST /v1/requests``, then its status polled until it ends;
* ``kafka_native``: an ``InferenceRequest`` produced straight onto the inbound topic;
* ``batch``: a few lines through the Files and Batches API (``openai`` SDK), their output file read at the end.

Half the requests are sampled with a seed (``temperature`` 0.9), half greedy; every prompt is new, so the
response cache never answers one. A request counts once it was accepted (202, a first streamed chunk, an
acknowledged produce, a created batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets
from openai import APIError, AsyncOpenAI

from benchmarks.nemesis_check import ClientKind
from schemas import InferenceRequest, Names, SamplingOptions
from schemas.names import batch_request_id
from sluicegate.kafka import create_producer

ENDED = ("finished", "cancelled", "failed")
WORDS = ["harbour", "river", "lamp", "snow", "pass", "stone", "field", "bell", "tide", "orchard"]


@dataclass
class Sent:
    """One accepted request, as its client saw it."""

    client: ClientKind
    sampled: bool
    received_seqs: list[int] | None = None
    client_finished: bool | None = None


@dataclass
class Clients:
    """Shared by every client loop: where to send, what was accepted, what was refused."""

    ingress: str
    result_ws: str
    api_key: str
    model: str
    names: Names
    kafka_bootstrap: str
    max_tokens: int
    seed: int
    sent: dict[str, Sent] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    batches: list[str] = field(default_factory=list)
    _n: int = 0

    def _body(self, rng: random.Random) -> tuple[dict[str, Any], bool]:
        self._n += 1
        sampled = self._n % 2 == 0
        prompt = f"{self._n} " + " ".join(rng.choices(WORDS, k=6))  # new every time: no response-cache hit
        # Some requests outlast a session timeout, so a worker faulted mid-request is still generating when
        # another takes its partitions over.
        tokens = rng.randint(min(32, self.max_tokens), self.max_tokens)
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        body |= {"temperature": 0.9, "seed": rng.randrange(1 << 30)} if sampled else {"temperature": 0}
        return body, sampled

    def _refuse(self, kind: str, why: object) -> None:
        key = f"{kind}:{why}"
        self.refused[key] = self.refused.get(key, 0) + 1

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    async def openai_sse(self, rng: random.Random) -> None:
        body, sampled = self._body(rng)
        sdk = AsyncOpenAI(base_url=f"{self.ingress}/v1", api_key=self.api_key, max_retries=0, timeout=180)
        rid, finished = None, False
        try:
            stream = await sdk.completions.create(
                model=self.model,
                prompt=body["prompt"],
                max_tokens=body["max_tokens"],
                temperature=body["temperature"],
                seed=body.get("seed"),
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if rid is None:
                    rid = chunk.id.removeprefix("cmpl-")
                    self.sent[rid] = Sent("openai_sse", sampled, client_finished=False)
                finished = finished or any(c.finish_reason for c in chunk.choices)
        except (APIError, httpx.HTTPError) as exc:
            if rid is None:
                self._refuse("openai_sse", getattr(exc, "status_code", type(exc).__name__))
        finally:
            await sdk.close()
        if rid is not None:
            self.sent[rid].client_finished = finished

    async def _submit(self, http: httpx.AsyncClient, kind: ClientKind, rng: random.Random) -> dict[str, Any] | None:
        body, sampled = self._body(rng)
        try:
            response = await http.post("/v1/requests", json={"model": self.model, **body})
        except httpx.HTTPError as exc:
            self._refuse(kind, type(exc).__name__)
            return None
        if response.status_code != 202:
            self._refuse(kind, response.status_code)
            return None
        accepted = response.json()
        self.sent[accepted["request_id"]] = Sent(kind, sampled, client_finished=False)
        return accepted

    async def websocket(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        accepted = await self._submit(http, "websocket", rng)
        if accepted is None:
            return
        rid, token = accepted["request_id"], accepted["stream_token"]
        sent = self.sent[rid]
        sent.received_seqs = []
        last_id, deadline = "0-0", time.monotonic() + 240
        while time.monotonic() < deadline:
            url = f"{self.result_ws}/v1/streams/{rid}?token={token}&last_id={last_id}"
            drop_after = rng.randint(3, 12)  # each connection is dropped after a few events and resumed
            try:
                async with websockets.connect(url, open_timeout=10) as socket:
                    for _ in range(drop_after):
                        message = json.loads(await asyncio.wait_for(socket.recv(), timeout=90))
                        sent.received_seqs.append(message["seq"])
                        last_id = message["id"]
                        if message["type"] in ("done", "error"):
                            sent.client_finished = True
                            return
            except (OSError, TimeoutError, websockets.WebSocketException):
                await asyncio.sleep(0.5)

    async def native(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        accepted = await self._submit(http, "native", rng)
        if accepted is None:
            return
        rid, deadline = accepted["request_id"], time.monotonic() + 240
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                response = await http.get(f"/v1/requests/{rid}")
                if response.status_code == 200 and response.json()["status"] in ENDED:
                    self.sent[rid].client_finished = True
                    return
            await asyncio.sleep(0.5)

    async def kafka_native(self, producer: Any, rng: random.Random) -> None:
        body, sampled = self._body(rng)
        request = InferenceRequest(
            request_id=f"kn-{uuid.uuid4().hex[:12]}",
            model=self.model,
            prompt=body["prompt"],
            sampling=SamplingOptions(
                max_tokens=body["max_tokens"],
                temperature=body["temperature"],
                seed=body.get("seed"),
                ignore_eos=True,
            ),
        )
        try:
            await producer.send_and_wait(self.names.inbound_topic, request.model_dump_json().encode())
        except Exception as exc:
            self._refuse("kafka_native", type(exc).__name__)
            return
        self.sent[request.request_id] = Sent("kafka_native", sampled)

    async def batch(self, rng: random.Random, lines: int) -> None:
        sdk = AsyncOpenAI(base_url=f"{self.ingress}/v1", api_key=self.api_key, max_retries=2, timeout=60)
        rows = []
        for n in range(lines):
            body, _ = self._body(rng)
            chat = {"model": self.model, "messages": [{"role": "user", "content": body["prompt"]}]}
            chat |= {k: v for k, v in body.items() if k != "prompt"}
            rows.append({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions", "body": chat})
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        try:
            upload = await sdk.files.create(file=("nemesis.jsonl", data), purpose="batch")
            created = await sdk.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        except (APIError, httpx.HTTPError) as exc:
            self._refuse("batch", getattr(exc, "status_code", type(exc).__name__))
            return
        finally:
            await sdk.close()
        self.batches.append(created.id)
        for line in range(1, lines + 1):
            self.sent[batch_request_id(created.id, line)] = Sent("batch", rows[line - 1]["body"]["temperature"] > 0)

    async def finish_batches(self, timeout_s: float) -> None:
        """Wait for every batch to end; a line whose custom id is not in exactly one output line did not finish."""
        sdk = AsyncOpenAI(base_url=f"{self.ingress}/v1", api_key=self.api_key, max_retries=2, timeout=60)
        deadline = time.monotonic() + timeout_s
        try:
            for batch_id in self.batches:
                state = await sdk.batches.retrieve(batch_id)
                while state.status not in ("completed", "failed", "expired", "cancelled"):
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(1.0)
                    state = await sdk.batches.retrieve(batch_id)
                seen: dict[str, int] = {}
                for file_id in (state.output_file_id, state.error_file_id):
                    if file_id:
                        text = (await sdk.files.content(file_id)).text
                        for row in text.splitlines():
                            custom = json.loads(row)["custom_id"]
                            seen[custom] = seen.get(custom, 0) + 1
                for line in range(1, (state.request_counts.total if state.request_counts else 0) + 1):
                    sent = self.sent.get(batch_request_id(batch_id, line))
                    if sent is not None:
                        sent.client_finished = seen.get(f"line-{line - 1}", 0) == 1
        finally:
            await sdk.close()

    async def run(self, stop: asyncio.Event, per_kind_interval_s: float, batch_every_s: float) -> None:
        """Every kind of client, each starting a request every ``per_kind_interval_s`` (not waiting for the last
        one), a batch of 4 lines every ``batch_every_s``, until ``stop``; then waits for their requests' ends."""
        rng = random.Random(self.seed)
        producer = create_producer(bootstrap=self.kafka_bootstrap)
        await producer.start()
        tasks: set[asyncio.Task[None]] = set()
        next_batch = batch_every_s / 2
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=self.ingress, headers=self._headers(), timeout=30) as http:
            kinds = [
                lambda: self.openai_sse(rng),
                lambda: self.websocket(http, rng),
                lambda: self.native(http, rng),
                lambda: self.kafka_native(producer, rng),
            ]
            while not stop.is_set():
                for start in kinds:
                    task = asyncio.create_task(start())
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if batch_every_s > 0 and time.monotonic() - started >= next_batch:
                    next_batch += batch_every_s
                    tasks.add(asyncio.create_task(self.batch(rng, 4)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), per_kind_interval_s * rng.uniform(0.5, 1.5))
            await asyncio.gather(*tasks, return_exceptions=True)
        await producer.stop()
