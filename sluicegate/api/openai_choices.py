"""OpenAI ``choices`` from an assembled stream: one per ``n``, with logprobs in the endpoint's shape and tool
calls read under the request's :class:`sluicegate.api.tool_calls.ToolPlan`; whole (:func:`whole_choices`) or as
streamed chunks (:class:`ChoiceChunks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas import DoneEvent, FinalResult, TokenEvent, TokenLogprob
from schemas.events import FinishReason

from .assembler import ChoiceDelta, StreamAssembler
from .openai_format import Kind, chat_logprobs, completion_logprobs
from .reasoning import ReasoningPlan, ReasoningStream, split_reasoning
from .tool_call_stream import ToolCallStream
from .tool_calls import ToolPlan, parse_output


@dataclass(frozen=True)
class ChoicePlan:
    """What a response's choices look like: how many, whether they carry logprobs, how tools are read, and how a
    chat output splits into reasoning and answer (None: all answer)."""

    kind: Kind
    n: int = 1
    logprobs: bool = False
    tools: ToolPlan = field(default_factory=ToolPlan)
    reasoning: ReasoningPlan | None = None


def _logprobs(plan: ChoicePlan, logprobs: list[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
    if not plan.logprobs:
        return None
    return chat_logprobs(logprobs) if plan.kind == "chat" else completion_logprobs(logprobs, offset)


def _with_calls(reason: FinishReason) -> str:
    """A choice that made tool calls ends with ``tool_calls`` when the model finished them; one cut short
    (``length``: the arguments may not parse) or ended otherwise keeps its reason, as OpenAI and vLLM say."""
    return "tool_calls" if reason == "stop" else reason


def whole_choices(assembler: StreamAssembler, plan: ChoicePlan) -> list[dict[str, Any]]:
    """Every choice of a finished request."""
    choices = []
    for index in range(plan.n):
        text = assembler.choice_text(index)
        reason: str = assembler.finish_reason(index)
        logprobs = _logprobs(plan, assembler.choice_logprobs(index))
        if plan.kind == "completion":
            choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
            continue
        reasoning = None
        if plan.reasoning is not None:
            reasoning, text = split_reasoning(text, plan.reasoning)
        content, calls = parse_output(text, plan.tools)
        if plan.tools.mode == "required" and not calls:
            content, calls = _streamed_message(text, plan.tools)  # cut short: what the stream would have sent
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if plan.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
            reason = _with_calls(reason)
        choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
    return choices


def _streamed_message(text: str, tools: ToolPlan) -> tuple[str | None, list[dict[str, Any]] | None]:
    """``(content, tool_calls)`` put together from the deltas a stream of ``text`` sends: for an output the
    whole-text parser cannot read (a forced call cut by ``max_tokens``), whole and streamed answers agree."""
    stream = ToolCallStream(tools)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d["content"] for d in deltas if "content" in d) or None
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            if "id" in piece:  # a call's header: its id, type and name (arguments "")
                calls[piece["index"]] = {"id": piece["id"], "type": piece["type"], "function": dict(piece["function"])}
            else:
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)] or None


class ChoiceChunks:
    """Turns the assembler's per-choice deltas into streamed chunk choices."""

    def __init__(self, plan: ChoicePlan) -> None:
        self.plan = plan
        self._tools = {i: ToolCallStream(plan.tools) for i in range(plan.n)}
        reasoning = plan.reasoning if plan.kind == "chat" else None
        self._reasoning = {i: ReasoningStream(reasoning) for i in range(plan.n)} if reasoning is not None else {}
        self._offsets = dict.fromkeys(range(plan.n), 0)
        self._ended: set[int] = set()

    def opening(self) -> list[dict[str, Any]]:
        """Chat: each choice's first delta names the role."""
        if self.plan.kind != "chat":
            return []
        content: str | None = "" if self.plan.tools.mode in ("content", "auto") else None
        return [
            {"index": i, "delta": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": None}
            for i in range(self.plan.n)
        ]

    def _choice(
        self, index: int, delta: dict[str, Any], logprobs: list[TokenLogprob] | None, reason: str | None
    ) -> dict[str, Any]:
        lp = _logprobs(self.plan, logprobs or []) if logprobs else None
        if self.plan.kind == "chat":
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        if lp is not None:
            lp = completion_logprobs(logprobs or [], self._offsets[index])
        self._offsets[index] += len(delta.get("content", ""))
        return {"index": index, "text": delta.get("content", ""), "logprobs": lp, "finish_reason": reason}

    def feed(self, deltas: list[ChoiceDelta]) -> list[dict[str, Any]]:
        """Chunk choices for what the assembler relays now (a choice's end closes it)."""
        out: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.index >= self.plan.n or delta.index in self._ended:
                continue
            messages = (
                self._chat_messages(delta.index, delta.text) if self.plan.kind == "chat" else [{"content": delta.text}]
            )
            messages = [m for m in messages if m.get("content") != ""] or ([{}] if delta.logprobs else [])
            for position, message in enumerate(messages):
                out.append(self._choice(delta.index, message, delta.logprobs if position == 0 else None, None))
            if delta.finish_reason is not None:
                out.extend(self.close(delta.index, delta.finish_reason))
        return out

    def _chat_messages(self, index: int, text: str, *, final: bool = False) -> list[dict[str, Any]]:
        """A chat choice's deltas for its new ``text``: the reasoning it holds, then the answer as the tool-call
        reader relays it (``final``: the choice ended, nothing is held back any more)."""
        reasoning, content = "", text
        splitter = self._reasoning.get(index)
        if splitter is not None:
            reasoning, content = splitter.feed(text)
            if final:
                more_reasoning, more_content = splitter.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        tools = self._tools[index]
        messages = [{"reasoning_content": reasoning}] if reasoning else []
        messages += tools.feed(content)
        return messages + (tools.finish() if final else [])

    def close(self, index: int, reason: FinishReason) -> list[dict[str, Any]]:
        """A choice's held deltas and its closing chunk choice."""
        if index in self._ended:
            return []
        self._ended.add(index)
        tools = self._tools[index]
        out = (
            [self._choice(index, message, None, None) for message in self._chat_messages(index, "", final=True)]
            if self.plan.kind == "chat"
            else []
        )
        final = _with_calls(reason) if tools.called else reason
        out.append(self._choice(index, {}, None, final))
        return out

    def close_all(self, assembler: StreamAssembler) -> list[dict[str, Any]]:
        """At ``done``: close every choice still open."""
        out: list[dict[str, Any]] = []
        for index in range(self.plan.n):
            out.extend(self.close(index, assembler.finish_reason(index)))
        return out


def result_choices(
    kind: Kind, result: FinalResult, logprobs: bool, tools: ToolPlan | None = None
) -> list[dict[str, Any]]:
    """The choices of a finished request from its :class:`schemas.FinalResult` (the Batch API's output)."""
    assembler = StreamAssembler()
    seq = 0
    for choice in result.choices or []:
        assembler.feed_choices(
            TokenEvent(
                request_id=result.request_id,
                seq=seq,
                text=choice.text,
                token_ids=choice.token_ids,
                index=choice.index,
                logprobs=choice.logprobs,
                finish_reason=choice.finish_reason,
            )
        )
        seq += 1
    if not result.choices:
        assembler.feed_choices(
            TokenEvent(request_id=result.request_id, seq=0, text=result.text, token_ids=result.token_ids)
        )
        seq = 1
    assembler.feed_choices(
        DoneEvent(request_id=result.request_id, seq=seq, finish_reason=result.finish_reason, usage=result.usage)
    )
    plan = ChoicePlan(kind, n=max(1, len(result.choices or [])), logprobs=logprobs, tools=tools or ToolPlan())
    return whole_choices(assembler, plan)
