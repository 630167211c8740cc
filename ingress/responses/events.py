"""A response's streamed events, derived from its request's Redis stream: the same entries, fed in stream order,
always give the same events with the same ``sequence_number`` and the same ids, whichever ingress reads them and
however its reads are batched. That is what lets ``GET /v1/responses/{id}?stream=true&starting_after=N`` resume
through any ingress: it replays the stream kept in Redis from its first entry and sends the events numbered above N.

The order is OpenAI's: ``response.created`` (and ``response.queued`` for a background response, whose
``response.in_progress`` waits for the first entry; a foreground one is in progress at once); per output item
``response.output_item.added``, for a message ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``, for a function call
``response.function_call_arguments.delta``... and ``.done``; then ``response.output_item.done``; and one terminal
event: ``response.completed`` (finish ``stop``), ``response.incomplete`` (``length``: ``max_output_tokens``; or a
cancel: the object's status is ``cancelled``) or ``response.failed`` (an error event, or a regeneration after a
worker restart that contradicts text already derived).

Text goes through the chat path's readers: :class:`sluicegate.api.assembler.StreamAssembler` (dedupe by ``seq``,
restarts) and :class:`sluicegate.api.tool_call_stream.ToolCallStream` (tool calls as they are written), with ids
derived from the request id instead of random ones.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from schemas import StreamEvent
from sluicegate.api.assembler import StreamAssembler
from sluicegate.api.tool_call_stream import ToolCallStream

from .objects import ResponseRecord, Status, openai_usage, response_error, response_object


class ResponseEvents:
    """Feed a request's stream events in order; read the events to send, and :meth:`response` at any point."""

    def __init__(self, record: ResponseRecord) -> None:
        self.record = record
        self.sequence = 0
        self.status: Status = "queued" if record.background else "in_progress"
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        self.completed_at: int | None = None  # unix seconds, once completed (as OpenAI's object says)
        #: The pipeline's own error code and message when the response failed (for an HTTP status).
        self.failure: tuple[str, str] | None = None
        self._assembler = StreamAssembler()
        self._tools = ToolCallStream(record.plan.plan())
        self._started = False
        self._message: int | None = None  # output index of the open message item
        self._call: int | None = None  # output index of the open function call item
        self._calls: dict[int, int] = {}  # tool call index -> output index

    @property
    def finished(self) -> bool:
        """A terminal event was derived."""
        return self.status in ("completed", "incomplete", "failed", "cancelled")

    def response(self) -> dict[str, Any]:
        """The response object as of the events derived so far."""
        return response_object(
            self.record,
            status=self.status,
            output=self.output,
            usage=self.usage,
            error=self.error,
            incomplete_details=self.incomplete_details,
            completed_at=self.completed_at,
        )

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _lifecycle(self, kind: str) -> dict[str, Any]:
        return self._event(kind, response=self.response())

    def opening(self) -> list[dict[str, Any]]:
        """The events before the stream's first entry."""
        second = "response.queued" if self.record.background else "response.in_progress"
        return [self._lifecycle("response.created"), self._lifecycle(second)]

    def feed(self, event: StreamEvent) -> list[dict[str, Any]]:
        """The events one stream event makes (often one delta, sometimes none)."""
        if self.finished:
            return []
        out: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            if self.record.background:
                self.status = "in_progress"
                out.append(self._lifecycle("response.in_progress"))
        assembler = self._assembler
        deltas = assembler.feed_choices(event)
        if assembler.diverged:
            message = "The worker restarted this response and produced different text."
            self.failure = ("stream_diverged", message)
            return out + self._fail({"code": "server_error", "message": message})
        for delta in deltas:
            if delta.index == 0 and delta.text:
                for message_delta in self._tools.feed(delta.text):
                    out += self._apply(message_delta)
        if assembler.error is not None:
            self.failure = (assembler.error.code, assembler.error.message)
            return out + self._fail(response_error(assembler.error.code, assembler.error.message))
        if assembler.done is None:
            return out
        for message_delta in self._tools.finish():
            out += self._apply(message_delta)
        reason = assembler.done.finish_reason
        if reason == "error":
            self.failure = ("worker_error", "The request failed on the worker.")
            return out + self._fail({"code": "server_error", "message": "The request failed on the worker."})
        if not self.output and reason in ("stop", "length"):
            out += self._open_message()  # an empty answer is still a message, so output_text is ""
        out += self._close_open("completed" if reason == "stop" else "incomplete")
        self.usage = openai_usage(assembler.done.usage)
        if reason == "stop":
            self.status, self.completed_at = "completed", int(time.time())
            return [*out, self._lifecycle("response.completed")]
        if reason == "length":
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        else:  # abort: the response was cancelled (its cancel endpoint, or a foreground client that left)
            self.status = "cancelled"
        return [*out, self._lifecycle("response.incomplete")]

    def _fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close_open(status="incomplete")
        self.status, self.error = "failed", error
        return [*out, self._lifecycle("response.failed")]

    # --- output items --------------------------------------------------------------------------------
    def _apply(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one message delta of the tool-call reader (content, a call's header or arguments)."""
        out: list[dict[str, Any]] = []
        content = delta.get("content")
        if content:
            if self._message is None:
                out += self._close_open()
                out += self._open_message()
            index = self._message
            assert index is not None
            part = self.output[index]["content"][0]
            part["text"] += content
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self.output[index]["id"],
                    output_index=index,
                    content_index=0,
                    delta=content,
                    logprobs=[],
                )
            )
        for call in delta.get("tool_calls", []):
            number = call["index"]
            if "id" in call:  # a call's header: it opens an item of its own
                out += self._close_open()
                out += self._open_call(number, call["function"]["name"])
            arguments = call["function"].get("arguments", "")
            if arguments and number in self._calls:
                index = self._calls[number]
                self.output[index]["arguments"] += arguments
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self.output[index]["id"],
                        output_index=index,
                        delta=arguments,
                    )
                )
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        index = len(self.output)
        item_id = f"msg_{self.record.request_id}_{index}"
        self.output.append(
            {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        )
        added = self._event("response.output_item.added", output_index=index, item=_copy(self.output[index]))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output[index]["content"].append(part)
        self._message = index
        opened = self._event(
            "response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=_copy(part)
        )
        return [added, opened]

    def _open_call(self, number: int, name: str) -> list[dict[str, Any]]:
        index = len(self.output)
        rid = self.record.request_id
        item = {
            "id": f"fc_{rid}_{index}",
            "type": "function_call",
            "status": "in_progress",
            "call_id": f"call_{rid}_{number}",
            "name": name,
            "arguments": "",
        }
        self.output.append(item)
        self._calls[number] = index
        self._call = index
        return [self._event("response.output_item.added", output_index=index, item=_copy(item))]

    def _close_open(self, status: str = "completed") -> list[dict[str, Any]]:
        """The ``.done`` events of the open items (a message, a function call), in the order they opened."""
        out: list[dict[str, Any]] = []
        for index in sorted(i for i in (self._message, self._call) if i is not None):
            item = self.output[index]
            item["status"] = status
            if item["type"] == "message":
                part = item["content"][0]
                common = {"item_id": item["id"], "output_index": index, "content_index": 0}
                out.append(self._event("response.output_text.done", **common, text=part["text"], logprobs=[]))
                out.append(self._event("response.content_part.done", **common, part=_copy(part)))
            else:
                out.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            out.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        self._message = self._call = None
        return out


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(value)
