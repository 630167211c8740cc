"""The one request value: what a front end builds from its caller's arguments and hands to the engine.

A front end builds one ``EngineRequest`` per request and passes that single value on: to admission (which
returns it with the prompt's token ids filled in), across ``ProcessEngine``'s process boundary (it is plain
data and pickles) and into ``LLMEngine.submit``, which turns it into the engine's ``Sequence``. Its own
fields are checked on construction; what depends on the model (tokenizing, lengths) is admission's job.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..lora.request import LoRARequest
from ..sampling_params import SamplingParams

#: A prompt as callers give it: text, or token ids (a resumed request passes prompt + delivered tokens).
PromptInput = str | list[int]

#: How an embedding request pools the final normed hidden states of its prompt: the last token's (vLLM's
#: default for decoder models) or the mean over every token. Either is L2-normalized.
POOLING_METHODS = ("last", "mean")


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class EngineRequest:
    """One request: its prompt, how to decode it, and where it stands in the queue.

    ``priority`` is the scheduling tier, an int where lower runs first (vLLM's convention); ``tenant``
    shares a tier fairly between callers; ``deadline`` (``time.time()`` seconds, optional) puts the request
    ahead of those without one in its tier, earliest deadline first. ``prompt_token_ids`` is None until
    admission tokenizes the prompt. ``pooling`` (one of ``POOLING_METHODS``) makes it an embedding request:
    prefill only, never served from or into the prefix cache, finished after its prefill with the pooled
    vector instead of a token. ``lora_request`` names the LoRA adapter to decode with (None: the base model).
    """

    prompt: PromptInput
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=new_request_id)
    priority: int = 0
    tenant: str = "default"
    arrival_time: float = field(default_factory=time.time)  # ``time.time()`` when the front end built it
    prompt_token_ids: list[int] | None = None
    deadline: float | None = None
    pooling: str | None = None
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(self.params).__name__}")
        # bool is an int to Python, but True/False as a tier is a caller's mistake.
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"unknown priority {self.priority!r}: a priority is an int, lower runs first")
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError(f"tenant must be a non-empty string, got {self.tenant!r}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request id must be a non-empty string, got {self.request_id!r}")
        deadline = self.deadline
        if deadline is not None and (not isinstance(deadline, (int, float)) or isinstance(deadline, bool)):
            raise ValueError(f"deadline must be time.time() seconds or None, got {self.deadline!r}")
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise ValueError(f"unknown pooling {self.pooling!r}: one of {', '.join(POOLING_METHODS)}")
        if self.pooling is not None and self.params.n != 1:
            raise ValueError("an embedding request has one choice (n=1)")
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(self.lora_request).__name__}")
        if self.lora_request is not None and self.pooling is not None:
            raise ValueError("embedding requests with a LoRA adapter are not supported")

    @classmethod
    def build(
        cls,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str = "default",
        deadline: float | None = None,
        pooling: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineRequest:
        """The request for a front end's keyword arguments, where None means the default."""
        return cls(
            prompt=prompt,
            params=SamplingParams() if params is None else params,
            request_id=new_request_id() if request_id is None else request_id,
            priority=priority,
            tenant=tenant,
            deadline=deadline,
            pooling=pooling,
            lora_request=lora_request,
        )

    @property
    def prompt_text(self) -> str | None:
        """The prompt's text, when it came as text."""
        return self.prompt if isinstance(self.prompt, str) else None

    @property
    def is_admitted(self) -> bool:
        return self.prompt_token_ids is not None
