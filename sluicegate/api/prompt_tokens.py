"""Counting a prompt's tokens before it is queued (ingress for a request, the batch service for a batch line)
exactly as the worker will: with the tokenizer and chat template the model's workers publish to Redis
(``schemas.ModelTokenizer`` under ``Names.tokenizer_key``), loaded with the ``tokenizers`` library (neither service
has model files), and the 400 when the prompt plus ``max_tokens`` is more than the context (OpenAI's
``context_length_exceeded``, worded as vLLM words it)."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from tokenizers import Tokenizer

from schemas import ChatMessage, InferenceRequest, ModelTokenizer, Names, ToolSpec

from ..chat_template import compile_template, template_message
from .errors import ApiError


class ModelTokenizerView:
    """One published tokenizer, loaded: encode, render the chat template, decode."""

    def __init__(self, published: ModelTokenizer) -> None:
        self.published = published
        self.tokenizer = Tokenizer.from_str(published.tokenizer_json)
        self.template = compile_template(published.chat_template) if published.chat_template else None

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat prompt text (``ValueError`` without a template or when the template refuses);
        ``template_kwargs``: the request's extra template variables (``chat_template_kwargs``)."""
        if self.template is None:
            raise ValueError(f"model {self.published.model!r} has no chat template; send 'prompt' instead")
        return self.template.render(
            **(template_kwargs or {}),
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.published.bos_token or "",
            eos_token=self.published.eos_token or "",
        )

    def render_messages(
        self,
        messages: list[ChatMessage],
        tools: list[ToolSpec] | None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat prompt text of the pipeline's messages and tools."""
        tool_dicts = [t.model_dump(mode="json", exclude_none=True) for t in tools] if tools else None
        return self.render([template_message(m) for m in messages], tool_dicts, add_generation_prompt, template_kwargs)

    def encode_messages(
        self,
        messages: list[ChatMessage],
        tools: list[ToolSpec] | None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Chat messages through the template, then tokenized (the template writes the special tokens)."""
        text = self.render_messages(messages, tools, add_generation_prompt, template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def render_request(self, request: InferenceRequest) -> str:
        """A chat request's prompt text, as the worker renders it."""
        assert request.messages is not None
        return self.render_messages(request.messages, request.tools, True, request.chat_template_kwargs)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_request(self, request: InferenceRequest) -> list[int]:
        """The request's prompt token ids, as the worker's ``prompt_token_ids`` makes them."""
        if request.messages is not None:
            return self.encode_messages(request.messages, request.tools, True, request.chat_template_kwargs)
        if isinstance(request.prompt, str):
            return self.encode_text(request.prompt)
        return list(request.prompt or [])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def check_in_vocabulary(self, ids: list[int], *, param: str) -> None:
        """A 400 naming ``param`` for the first token id the model does not have."""
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = next((t for t in ids if not 0 <= t < size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"Token id {bad} is outside the vocabulary (size {size}).",
                code="token_out_of_vocabulary",
                param=param,
            )


class ModelTokenizers:
    """The published tokenizers, re-read from Redis at most every ``refresh_s`` and reloaded only when the
    digest changes (a worker with another tokenizer took over the name)."""

    def __init__(self, redis: Redis, names: Names, *, refresh_s: float = 10.0) -> None:
        self.redis = redis
        self.names = names
        self.refresh_s = refresh_s
        self._loaded: dict[str, tuple[float, ModelTokenizerView | None]] = {}

    async def get(self, model: str) -> ModelTokenizerView | None:
        """The model's tokenizer; None when no worker has published one (or it is unreadable)."""
        now = time.monotonic()
        cached = self._loaded.get(model)
        if cached is not None and now - cached[0] < self.refresh_s:
            return cached[1]
        raw = await self.redis.get(self.names.tokenizer_key(model))
        view = cached[1] if cached is not None else None
        if raw is None:
            view = None
        else:
            try:
                published = ModelTokenizer.model_validate_json(raw)
            except ValidationError:
                published = None
            if published is None:
                view = None
            elif view is None or view.published.digest != published.digest:
                view = ModelTokenizerView(published)
        self._loaded[model] = (now, view)
        return view


def check_prompt_fits(
    prompt_tokens: int, max_tokens: int, context: int | None, *, explicit: bool, param: str = "messages"
) -> int:
    """``max_tokens`` when prompt + max_tokens fits the context; a default is lowered to the room left; else
    the 400 vLLM answers (``context_length_exceeded``)."""
    if context is None or prompt_tokens + max_tokens <= context:
        return max_tokens
    if not explicit and prompt_tokens < context:
        return context - prompt_tokens
    if param == "input":  # an embedding: the input alone, nothing generated
        message = (
            f"This model's maximum context length is {context} tokens. However, you requested {prompt_tokens} "
            "tokens in the input. Please reduce the length of the input."
        )
    else:
        what = "prompt" if param == "prompt" else "messages"
        message = (
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {what}, {max_tokens} in the completion). "
            f"Please reduce the length of the {what} or completion."
        )
    raise ApiError(400, message, code="context_length_exceeded", param=param)
