"""The draft-model proposer: a smaller model of the target's tokenizer samples up to ``k`` drafts per sequence,
one forward per draft position batched over the sequences, with its own paged KV cache kept in step with the
target's (vLLM's ``draft_model`` method).

Cache bookkeeping, per sequence (``DraftState``): ``block_ids`` from the draft's own block pool, laid out like
the target's block tables (slot = ``block_ids[pos // block_size] * block_size + pos % block_size``), and
``num_computed``, how many leading tokens of the sequence have K/V in the draft cache. Proposing for a sequence of
L tokens first catches the draft up on tokens ``[num_computed, L)``: the whole prompt the first time, whatever
the target took from its prefix cache or computed in chunks (the draft shares no blocks, so it never depends on
the target's cache state), then feeds d_1 .. d_{k-1} at positions L .. L+k-2. After verification ``rollback``
keeps exactly the accepted tokens: ``num_computed`` drops to L + accepted (rejected slots are overwritten later)
and blocks past it go back to the pool; ``propose`` also re-checks what was fed against the tokens the sequence
took, so a step that cut or skipped the drafts can never leave stale K/V in use. A sequence that ends gives its
blocks back (``release``); one that is no longer running (preempted) does so at the next ``propose`` and is caught
up from scratch when it runs again, as the target recomputes it. When the draft pool is short a sequence just
gets no drafts that step.

Random requests draw their drafts from the draft's own distribution q (the request's temperature, min_p and
top-k/top-p applied to the draft's logits; any q keeps the output exact, a closer one is accepted more often)
and q's rows go to the rejection sampler, which needs the full q for the output to be the target's
distribution. Greedy requests take the draft's argmax. The draft must have the target's vocabulary (logit width
and, when the draft folder has a tokenizer, the same token -> id map); the engine refuses it otherwise."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from ..attention import get_attention_backend
from ..config import EngineConfig
from ..core.counter_rng import Stream
from ..core.sequence import Sequence
from ..execution.model_runner import ModelRunner, kv_bytes_per_block
from ..execution.sampler import Sampler
from ..models.loader import load_model
from ..tokenizer import load_tokenizer
from .config import SpeculativeConfig


@dataclass
class Drafts:
    """A sequence's drafts and, for a random request, the draft distribution each was drawn from."""

    tokens: list[int]
    # [len(tokens), vocab] float32 rows of q; None for greedy requests (q is then never read).
    probs: torch.Tensor | None = None


@dataclass
class DraftState:
    """One sequence's place in the draft cache."""

    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    # The last proposal: the sequence's length then, and the drafts fed to the draft model after it (positions
    # base ..), checked against the tokens the sequence really took before the next proposal reuses the cache.
    base: int = 0
    fed: list[int] = field(default_factory=list)


class DraftBlockPool:
    """The draft cache's free block ids (no prefix sharing, so no reference counts)."""

    def __init__(self, num_blocks: int) -> None:
        # Popped from the end: low ids first, so a sequence's blocks tend to be consecutive (cheaper reads).
        self._free = list(range(num_blocks - 1, -1, -1))
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(count)]
        return taken

    def give(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))


class DraftModelProposer:
    def __init__(
        self,
        config: SpeculativeConfig,
        engine_config: EngineConfig,
        max_model_len: int,
        vocab_size: int,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        assert config.model is not None  # SpeculativeConfig checked it
        self.k = config.num_speculative_tokens
        draft_config = dataclasses.replace(
            engine_config,
            model=config.model,
            tokenizer=None,
            quantization=None,
            kv_cache_dtype="auto",
            speculative_config=None,
            # The draft reads every position the target does; a draft with a shorter context is refused here.
            max_model_len=max_model_len,
        )
        self.loaded = load_model(draft_config)
        check_same_vocabulary(self.loaded.path, self.loaded.vocab_size, vocab_size, tokenizer)
        self.model = self.loaded.model
        self.block_size = engine_config.block_size
        backend = get_attention_backend(
            engine_config.attention_backend, engine_config.device, self.block_size, self.loaded.dtype
        )
        # The runner owns the draft's cache tensor and binds it to the draft's layers; its batch builder lays out
        # the inputs. The draft runs eagerly (no CUDA graphs): its forwards are small next to the target's.
        self.runner = ModelRunner(self.loaded, backend, self.block_size)
        self.pool = DraftBlockPool(0)
        self.states: dict[Sequence, DraftState] = {}

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.loaded, self.block_size)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.pool = DraftBlockPool(num_blocks)

    # ------------------------------------------------------------------ cache bookkeeping
    def release_except(self, running: set[Sequence]) -> None:
        """Give back the blocks of every sequence not in ``running`` (finished, aborted or preempted)."""
        for seq in [s for s in self.states if s not in running]:
            self.pool.give(self.states.pop(seq).block_ids)

    def release(self, seq: Sequence) -> None:
        """Give back the blocks of a sequence that finished or was aborted."""
        state = self.states.pop(seq, None)
        if state is not None:
            self.pool.give(state.block_ids)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Keep the draft's K/V of the sequence's first ``num_valid`` tokens only (the accepted ones)."""
        state = self.states.get(seq)
        if state is None:
            return
        state.num_computed = min(state.num_computed, num_valid)
        keep = -(-state.num_computed // self.block_size)
        if len(state.block_ids) > keep:
            self.pool.give(state.block_ids[keep:])
            del state.block_ids[keep:]

    def _reserve(self, seq: Sequence, num_tokens: int) -> DraftState | None:
        """The sequence's state with blocks for ``num_tokens`` tokens, or None when the pool is short."""
        state = self.states.setdefault(seq, DraftState())
        needed = -(-num_tokens // self.block_size) - len(state.block_ids)
        if needed > 0:
            taken = self.pool.take(needed)
            if taken is None:
                return None
            state.block_ids += taken
        return state

    # ------------------------------------------------------------------ proposing
    def propose(self, seqs: list[Sequence], rooms: list[int], sampler: Sampler) -> list[Drafts]:
        """Up to ``min(k, room)`` drafts for each sequence (all in decode, each with ``room > 0``)."""
        out = [Drafts([]) for _ in seqs]
        live: list[tuple[int, DraftState, int]] = []  # (index in seqs, state, drafts wanted)
        for i, (seq, room) in enumerate(zip(seqs, rooms, strict=True)):
            want = min(self.k, room)
            # The draft cache holds the sequence's tokens and every draft but the last (never fed).
            state = self._reserve(seq, seq.num_tokens + want - 1)
            if state is not None:
                # Whatever the last verification did (or a step that trimmed or skipped the drafts), only fed
                # drafts the sequence took are valid; the last token is always fed again to predict d_1.
                taken = 0
                limit = min(len(state.fed), seq.num_tokens - state.base)
                while taken < limit and seq.token_ids[state.base + taken] == state.fed[taken]:
                    taken += 1
                state.num_computed = min(state.num_computed, state.base + taken, seq.num_tokens - 1)
                live.append((i, state, want))
        if not live:
            return out
        # Round 0 catches each sequence up and predicts d_1; round j feeds d_j and predicts d_{j+1}.
        feeds = [seqs[i].token_ids[state.num_computed :] for i, state, _ in live]
        starts = [state.num_computed for _, state, _ in live]
        for i, state, _ in live:
            state.base, state.fed = seqs[i].num_tokens, []
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        while live:
            logits = self._forward([state for _, state, _ in live], feeds, starts)
            offsets = [len(out[i].tokens) for i, _, _ in live]
            tokens, q = self._sample(sampler, logits, [seqs[i] for i, _, _ in live], offsets)
            next_live: list[tuple[int, DraftState, int]] = []
            feeds, starts = [], []
            for row, (i, state, want) in enumerate(live):
                out[i].tokens.append(tokens[row])
                if q is not None and q[row] is not None:
                    probs[i].append(q[row])
                if len(out[i].tokens) < want:
                    next_live.append((i, state, want))
                    feeds.append([tokens[row]])
                    starts.append(state.num_computed)
                    state.fed.append(tokens[row])
            live = next_live
        for i, rows in enumerate(probs):
            if rows:
                out[i].probs = torch.stack(rows)
        return out

    def _forward(self, states: list[DraftState], feeds: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Feed each state its tokens from position ``start`` on; float32 logits of each one's last token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for state, tokens, start in zip(states, feeds, starts, strict=True):
            end = start + len(tokens)
            input_ids += tokens
            positions += range(start, end)
            slots += [state.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + len(tokens))
            seq_lens.append(end)
            tables.append(state.block_ids)
            state.num_computed = end
        last = [q - 1 for q in query_start[1:]]
        max_q = max(len(t) for t in feeds)
        prepared = self.runner._build(input_ids, positions, slots, query_start, seq_lens, tables, last, [], max_q)
        with torch.inference_mode():
            hidden = self.model(prepared.input_ids, prepared.positions, prepared.meta)
            return self.model.compute_logits(hidden[prepared.logits_indices]).float()

    @staticmethod
    def _sample(
        sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], offsets: list[int]
    ) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """Each row's draft: the argmax for a greedy request, a draw from q for a random one (a seeded one's keyed
        by the draft's position: the sequence's next one plus ``offsets``); and q per row (None for greedy rows;
        None altogether when every request is greedy)."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            return tokens.tolist(), None
        index = torch.tensor(random_rows, device=logits.device)
        random_seqs = [seqs[i] for i in random_rows]
        q = Sampler.target_probs(logits[index], random_seqs)
        tokens[index] = sampler.draw(q, random_seqs, [offsets[i] for i in random_rows], Stream.DRAFT)
        per_row: list[torch.Tensor | None] = [None] * len(seqs)
        for j, i in enumerate(random_rows):
            per_row[i] = q[j]
        return tokens.tolist(), per_row


def build_draft_model(
    config: SpeculativeConfig | None,
    engine_config: EngineConfig,
    max_model_len: int,
    vocab_size: int,
    tokenizer: PreTrainedTokenizerBase,
) -> DraftModelProposer | None:
    """The draft-model proposer the speculative config asks for (loaded, cache not yet allocated), else None."""
    if config is None or config.method != "draft_model":
        return None
    return DraftModelProposer(config, engine_config, max_model_len, vocab_size, tokenizer)


def check_same_vocabulary(
    draft_path: object, draft_vocab: int, target_vocab: int, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Refuse a draft model whose token ids do not mean the target's: rejection compares p and q per token id."""
    if draft_vocab != target_vocab:
        raise ValueError(
            f"draft model {draft_path} has a vocabulary of {draft_vocab} tokens, the target {target_vocab}: "
            "speculative decoding needs a draft model of the same tokenizer"
        )
    try:
        draft_tokenizer = load_tokenizer(str(draft_path))
    except ValueError:
        return  # a draft folder without tokenizer files: the logit width is all there is to check
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"draft model {draft_path} has a different tokenizer from the target's (same size, other token ids): "
            "speculative decoding needs a draft model of the same tokenizer"
        )
