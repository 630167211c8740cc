"""Ingress's OpenAI server-sent events go out one write per read of the stream: what one read delivers is one
piece of the response body, and a finished stream's last chunks, usage and ``[DONE]`` share one write.

The stream is played by a stand-in for ``IngressService.event_batches`` (batches as the follower's reads would
deliver them); the chunks are parsed with the official ``openai`` types."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from openai.types import Completion

from ingress.openai_stream import StreamPart, sse_events
from ingress.telemetry import IngressMetrics
from schemas import DoneEvent, StreamEvent, TokenEvent, Usage
from sluicegate.api.openai_format import ResponseIds

USAGE = Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8)


class ReplayedStream:
    """What the service part of ``sse_events`` needs: the stream's batches, its settings, and cancel."""

    def __init__(self, batches: list[list[StreamEvent]]) -> None:
        self._batches = batches
        self.settings = SimpleNamespace(request_timeout_s=5.0, kafka_timeout_s=1.0)
        self.cancelled: list[str] = []

    async def event_batches(
        self, request_id: str, tenant: str, *, timeout_s: float
    ) -> AsyncIterator[list[StreamEvent]]:
        for batch in self._batches:
            yield batch

    async def cancel(self, request_id: str, tenant: str, *, reason: str) -> None:
        self.cancelled.append(reason)


def tok(seq: int, text: str) -> TokenEvent:
    return TokenEvent(request_id="r", seq=seq, text=text, token_ids=[seq])


def events(service: ReplayedStream, part: StreamPart | None = None) -> AsyncIterator[str]:
    ids = ResponseIds("completion", "r", "m", int(time.time()))
    return sse_events(
        service,  # type: ignore[arg-type]
        ids,
        tenant="t",
        include_usage=True,
        accepted_at=time.perf_counter(),
        metrics=IngressMetrics(),
        part=part,
    )


async def writes(batches: list[list[StreamEvent]]) -> tuple[list[str], ReplayedStream]:
    service = ReplayedStream(batches)
    return [piece async for piece in events(service)], service


def frames(piece: str) -> list[Any]:
    return ["[DONE]" if f == "data: [DONE]" else json.loads(f.removeprefix("data: ")) for f in piece.split("\n\n") if f]


async def test_one_write_per_read_and_the_end_in_one() -> None:
    done = DoneEvent(request_id="r", seq=3, finish_reason="length", usage=USAGE)
    got, service = await writes([[tok(0, "Hel"), tok(1, "lo")], [tok(2, " you")], [done]])
    assert len(got) == 3 and not service.cancelled
    first, second, last = (frames(piece) for piece in got)
    assert [c["choices"][0]["text"] for c in first] == ["Hel", "lo"]  # one read: one write of two chunks
    assert [c["choices"][0]["text"] for c in second] == [" you"]
    *closing, usage, end = last  # the finish, the usage chunk and [DONE] in one write
    assert end == "[DONE]" and usage["usage"]["completion_tokens"] == 3
    assert [Completion.model_validate(c).choices[0].finish_reason for c in closing] == ["length"]


async def test_the_last_tokens_read_with_the_end_share_its_write() -> None:
    done = DoneEvent(request_id="r", seq=2, finish_reason="stop", usage=USAGE)
    got, _ = await writes([[tok(0, "Hi")], [tok(1, "!"), done]])
    assert len(got) == 2
    last = frames(got[1])
    assert last[0]["choices"][0]["text"] == "!" and last[-1] == "[DONE]"
    text = "".join(
        c["choices"][0]["text"] for piece in got for c in frames(piece) if isinstance(c, dict) and c["choices"]
    )
    assert text == "Hi!"


async def test_a_part_stopped_before_its_end_is_cancelled_for_the_reason_its_response_gives() -> None:
    """A part of a list of prompts that the merged response stops (another part failed) cancels its request
    under the response's reason, not as a client that left."""
    service = ReplayedStream([[tok(0, "Hel")], [tok(1, "lo")]])
    part = StreamPart("r2", 2, on_done=lambda usage: None, stopped_because=lambda: "sibling_failed")
    pieces = events(service, part)
    first = await anext(pieces)
    assert frames(first)[0]["choices"][0]["index"] == 2  # numbered after the earlier part's two choices
    await pieces.aclose()
    assert service.cancelled == ["sibling_failed"]
