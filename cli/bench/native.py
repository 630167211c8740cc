"""``sluicegate bench --target native``: Sluicegate's native HTTP API as a WebSocket chat frontend or a gateway uses
it, a path no other load generator drives.

Each prompt is submitted with ``POST {base}/requests`` (answered 202 with a stream URL and token), then followed on
one WebSocket that the run keeps open: the result service's multiplexed ``/v1/streams`` (its URL is the submit
response's ``stream_url`` without the request id), subscribing each request with its token. TTFT is from the POST
sent to the first token event read; ITL the gaps between token events; token counts are the ``done`` event's usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from typing import Any

import httpx

from cli.bench.measure import Prompt, Sample, api_error


class _Followed:
    """One request's stream as events arrive on the shared socket."""

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_message(self, message: dict[str, Any], now: float) -> None:
        sample, kind = self.sample, message.get("type")
        if kind == "token":
            if message.get("token_ids"):
                sample.content_at(now)
            return
        if kind == "restart":
            return
        if kind == "done":
            sample.ended(now)
            usage = message.get("usage") or {}
            sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            sample.output_tokens = int(usage.get("completion_tokens") or 0)
        elif kind == "error":
            sample.error = f"{message.get('code')}: {message.get('message')}"[:200]
        else:  # closed or invalid: the relay refused or ended the subscription
            sample.error = f"stream {kind}: {message.get('code', '')} {message.get('reason', '')}".strip()[:200]
        if not self.ended.done():
            self.ended.set_result(None)


class NativeTarget:
    """Submits to ``POST /requests`` and follows every request's stream on one multiplexed WebSocket."""

    def __init__(self, args: argparse.Namespace, client: httpx.AsyncClient) -> None:
        self.args = args
        self.client = client
        self.model: str = args.model or ""
        self._socket: Any = None
        self._opening: asyncio.Lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._followed: dict[str, _Followed] = {}

    async def send(self, prompt: Prompt, sample: Sample) -> None:
        args = self.args
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": prompt.max_tokens,
            "temperature": args.temperature,
            "priority": args.priority,
        }
        if args.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        if args.ignore_eos:
            body["ignore_eos"] = True
        response = await self.client.post("requests", json=body)
        if response.status_code != 202:
            sample.error = api_error(response)
            return
        submitted = response.json()
        request_id = submitted["request_id"]
        followed = self._followed[request_id] = _Followed(sample)
        try:
            socket = await self._socket_for(submitted["stream_url"])
            subscribe = {"type": "subscribe", "request_id": request_id, "token": submitted["stream_token"]}
            await socket.send(json.dumps(subscribe))
            await asyncio.wait_for(followed.ended, max(0.0, sample.sent + args.timeout - time.monotonic()))
        except TimeoutError:
            sample.error = f"no done event within {args.timeout:g} s"
        except OSError as exc:
            sample.error = f"stream socket: {exc!r}"[:200]
        finally:
            self._followed.pop(request_id, None)

    async def _socket_for(self, stream_url: str) -> Any:
        """The run's multiplexed socket, opened at the first submit (its URL is where ``stream_url`` points)."""
        async with self._opening:
            if self._socket is None:
                from websockets.asyncio.client import connect

                url = stream_url.rsplit("/", 1)[0]
                self._socket = await connect(url, max_size=2**24, open_timeout=10)
                self._reader = asyncio.create_task(self._read(self._socket))
            return self._socket

    async def _read(self, socket: Any) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            async for raw in socket:
                now = time.monotonic()
                message = json.loads(raw)
                followed = self._followed.get(message.get("request_id") or "")
                if followed is not None:
                    followed.on_message(message, now)
        except ConnectionClosed as exc:
            reason = f"the stream socket closed: {exc}"
        else:
            reason = "the stream socket closed"
        for followed in list(self._followed.values()):
            followed.sample.error = followed.sample.error or reason[:200]
            if not followed.ended.done():
                followed.ended.set_result(None)
        self._socket = None

    async def close(self) -> None:
        if self._socket is not None:
            await self._socket.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
