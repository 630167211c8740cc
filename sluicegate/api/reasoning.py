"""Splitting a chat choice's output into the model's reasoning and its answer (vLLM's ``reasoning_content``), whole
or as streamed pieces.

Reasoning models of the Qwen3 and DeepSeek-R1 families write their thinking between ``<think>`` and ``</think>``
before the answer. Either the model opens the span itself (Qwen3's template with thinking on), or the chat template
already opened it at the end of the prompt (DeepSeek-R1, Qwen3's thinking-only releases): the output then starts
inside the reasoning and holds only the ``</think>``. Which parser a model needs (:data:`schemas.ReasoningParser`)
is advertised by its workers (read from the chat template, or set by ``SLUICEGATE_REASONING_PARSER``); whether the
prompt opened the span is read from the prompt ingress renders with the template the workers publish
(:func:`reasoning_plan`). Where ingress cannot render it (no tokenizer published yet), ``qwen3`` assumes the model
opens the span and ``deepseek_r1`` that the prompt did, as vLLM's parsers of those names do.

A ``<think>`` counts only at the start of the output (after whitespace); a tag split across tokens is held back until
it is whole, so no piece of a tag reaches the client. Whitespace right after either tag is dropped. A template that
closed an empty span in the prompt (Qwen3 with ``enable_thinking: false``) leaves the model's output all content.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import InferenceRequest, ReasoningParser, WorkerHeartbeat

from .prompt_tokens import ModelTokenizers

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's chat output is split: ``opened`` when its prompt ends inside a ``<think>`` span."""

    parser: ReasoningParser
    opened: bool = False


def advertised_reasoning_parser(heartbeats: list[WorkerHeartbeat]) -> ReasoningParser | None:
    """The one reasoning parser a model's workers advertise (None when none or they disagree)."""
    parsers = {b.reasoning_parser for b in heartbeats if b.reasoning_parser}
    return parsers.pop() if len(parsers) == 1 else None


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered chat prompt ends inside a ``<think>`` span (the template opened it for the model)."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)


async def reasoning_plan(
    tokenizers: ModelTokenizers, request: InferenceRequest, parser: ReasoningParser | None
) -> ReasoningPlan | None:
    """The plan for a chat request to a model whose workers advertise ``parser`` (None: its output is all
    content). The prompt is rendered with the published template to see whether it opened the span."""
    if parser is None or request.messages is None:
        return None
    view = await tokenizers.get(request.model)
    if view is None or view.template is None:
        return ReasoningPlan(parser, opened=parser == "deepseek_r1")
    try:
        prompt = view.render_request(request)
    except Exception:  # a template's own refusal: the worker reports it, and the output is then empty anyway
        return ReasoningPlan(parser, opened=parser == "deepseek_r1")
    return ReasoningPlan(parser, opened=prompt_opens_reasoning(prompt))


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (a tag the next piece may complete)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """One choice's output, fed piece by piece: each :meth:`feed` returns the ``(reasoning, content)`` text it
    makes sure of; :meth:`finish` returns what was held back when the output ends."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self._state = "reasoning" if plan.opened else "start"
        self._strip = plan.opened  # drop the whitespace that follows a tag
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = ""
        while True:
            if self._state == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._held = stripped[len(THINK_OPEN) :]
                    self._state, self._strip = "reasoning", True
                    continue
                if THINK_OPEN.startswith(stripped):  # nothing yet, or a tag still being written
                    return reasoning, ""
                self._state = "content"  # the output opened no span: all of it is the answer
                return reasoning, self._take_content()
            if self._state == "reasoning":
                if self._strip:
                    self._held = self._held.lstrip()
                    if not self._held:
                        return reasoning, ""
                    self._strip = False
                end = self._held.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += self._held[:end]
                    self._held = self._held[end + len(THINK_CLOSE) :]
                    self._state, self._strip = "content", True
                    return reasoning, self._take_content()
                keep = len(self._held) - _partial_tag(self._held, THINK_CLOSE)
                reasoning += self._held[:keep]
                self._held = self._held[keep:]
                return reasoning, ""
            return reasoning, self._take_content()

    def _take_content(self) -> str:
        if self._strip:
            self._held = self._held.lstrip()
            if not self._held:
                return ""
            self._strip = False
        content, self._held = self._held, ""
        return content

    def finish(self) -> tuple[str, str]:
        """What was held at the end: a partial tag is text after all (a span never closed is all reasoning)."""
        held, self._held = self._held, ""
        if self._strip:
            held = held.lstrip()
        return (held, "") if self._state == "reasoning" else ("", held)


def split_reasoning(text: str, plan: ReasoningPlan) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a finished choice's text; reasoning is None when it has none."""
    stream = ReasoningStream(plan)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning) or None, content + more_content
