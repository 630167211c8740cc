"""Building the engine's :class:`Sequence` for an admitted request, and for each further choice of one (``n`` > 1):
its detokenizer, its seeded random stream, its grammar matcher (the grammar compiler is built on the first guided
request), and its arrival rank."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch

from ..detokenizer import IncrementalDetokenizer
from ..guided import GuidedDecoding
from ..sampling_params import SamplingParams
from .admission import max_output_tokens
from .counter_rng import SeededStream
from .request import EngineRequest
from .sequence import Sequence

if TYPE_CHECKING:
    from ..guided.compiler import GrammarCompiler
    from ..guided.matcher import GuidedState
    from ..guided.utf8_mask import Utf8Table


class SequenceFactory:
    """Makes the sequences of one engine (its tokenizer, stop tokens, context and device)."""

    def __init__(
        self, tokenizer: Any, eos_token_ids: frozenset[int], vocab_size: int, max_model_len: int, device: torch.device
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.special_token_ids = frozenset(tokenizer.all_special_ids)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = device
        # Built on the first guided request (it indexes the whole vocabulary once).
        self.grammar_compiler: GrammarCompiler | None = None
        self._utf8_table: Utf8Table | None = None  # built with the compiler (per tokenizer)
        self._arrivals = itertools.count()

    def make(self, request: EngineRequest) -> Sequence:
        """The engine's state for an admitted request (its own random generator, detokenizer, arrival rank)."""
        params = request.params
        prompt_token_ids = request.prompt_token_ids
        assert prompt_token_ids is not None  # admitted
        return Sequence(
            request_id=request.request_id,
            prompt=request.prompt_text,
            prompt_token_ids=prompt_token_ids,
            params=params,
            priority=request.priority,
            arrival_time=request.arrival_time,
            arrival_index=next(self._arrivals),
            # An embedding request generates nothing (no token room: never a speculative draft either).
            max_tokens=0 if request.pooling else max_output_tokens(len(prompt_token_ids), params, self.max_model_len),
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, self.special_token_ids
            ),
            rng=self._rng(params, 0),
            tenant=request.tenant,
            deadline=request.deadline,
            logprobs=[] if params.logprobs is not None else None,
            guided=self._guided_state(params.guided) if params.guided is not None else None,
            pooling=request.pooling,
            lora_request=request.lora_request,
        )

    def _rng(self, params: SamplingParams, index: int) -> SeededStream | None:
        """The choice's keyed random draws when the request is seeded, under the choice's seed ``seed + index``
        (the seed a resumed choice is re-submitted with, so it draws what the first run drew)."""
        if params.seed is None:
            return None
        return SeededStream(params.seed + index, self.device)

    def sibling(self, parent: Sequence, index: int) -> Sequence:
        """Choice ``index`` of ``parent``'s request, at the same point (prompt computed, nothing generated)."""
        params = parent.params
        return Sequence(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            params=params,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            arrival_index=parent.arrival_index,
            max_tokens=parent.max_tokens,
            eos_token_ids=parent.eos_token_ids,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, parent.prompt_token_ids, params.skip_special_tokens, self.special_token_ids
            ),
            rng=self._rng(params, index),
            tenant=parent.tenant,
            deadline=parent.deadline,
            token_ids=list(parent.token_ids),
            num_cached_tokens=parent.num_cached_tokens,
            first_scheduled_time=parent.first_scheduled_time,
            index=index,
            logprobs=[] if params.logprobs is not None else None,
            guided=parent.guided.fork() if parent.guided is not None else None,
            lora_request=parent.lora_request,
        )

    def _guided_state(self, guided: GuidedDecoding) -> GuidedState:
        """A fresh matcher for the request's grammar (compiled once per constraint), replayed past the tokens
        delivered before a crash; ``ValueError`` for a bad constraint or a replay the grammar refuses."""
        from ..guided.compiler import GrammarCompiler
        from ..guided.matcher import GuidedState
        from ..guided.utf8_mask import Utf8Table
        from ..token_bytes import vocab_bytes

        if self.grammar_compiler is None:
            self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
            skipped = set(self.tokenizer.all_special_ids) - set(self.eos_token_ids)
            self._utf8_table = Utf8Table(vocab_bytes(self.tokenizer, self.vocab_size), refused=skipped)
        assert self._utf8_table is not None
        return GuidedState(self.grammar_compiler.compile(guided), guided, self._utf8_table)
