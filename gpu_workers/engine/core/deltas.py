"""What a step reports for each sequence: whether a new token ends it (EOS, stop tokens, stop strings), the delta
since its last report (text held back while it could still grow into a stop string), and its final output."""

from __future__ import annotations

from ..outputs import RequestDelta, RequestMetrics, RequestOutput
from .sequence import RequestStatus, Sequence


def check_stop(seq: Sequence, token: int, delta: str) -> RequestStatus | None:
    """How ``seq`` ends with ``token`` (whose text is ``delta``) appended, or None: EOS, a stop token or a stop
    string (the text is cut before it), never before ``min_tokens``."""
    params = seq.params
    if seq.num_output_tokens < params.min_tokens:
        return None
    if token in seq.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if token in params.stop_token_ids:
        seq.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if params.stop_list and delta:
        text = seq.text
        # A match must involve the new text; earlier text was already checked.
        search_from = max(0, len(text) - len(delta) - params.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in params.stop_list:
            idx = text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is not None:
            seq.text = text[: best[0]]
            seq.stop_reason = best[1]
            return RequestStatus.FINISHED_STOPPED
    return None


def delta_due(seq: Sequence, now: float, interval_s: float) -> bool:
    """Whether this step hands out ``seq``'s delta: its first output and its end at once, otherwise once
    ``interval_s`` passed since its last one (0: every step). Tokens made meanwhile ride in the next delta, which
    :func:`make_delta` builds from everything not yet sent; fewer, larger deltas are what every hop after the
    engine (the pipe to the worker, the stream appends, the relay's frames) pays for per message."""
    last = seq.last_delta_time
    if interval_s > 0 and last is not None and not seq.is_finished and now - last < interval_s:
        return False
    seq.last_delta_time = now
    return True


def make_delta(seq: Sequence) -> RequestDelta:
    """What ``seq`` produced since its last delta (its final output too once it finished)."""
    finished = seq.is_finished
    if finished:
        emit_to = len(seq.text)
    else:
        # Hold back a tail that could still grow into a stop string (it would be cut).
        held = seq.params.max_stop_len - 1 if seq.params.stop_list else 0
        emit_to = max(seq.num_text_sent, len(seq.text) - held)
    text = seq.text[seq.num_text_sent : emit_to]
    seq.num_text_sent = emit_to
    start = seq.num_prompt_tokens + seq.num_tokens_sent
    new_tokens = seq.token_ids[start:]
    new_logprobs = seq.logprobs[seq.num_tokens_sent :] if seq.logprobs is not None else None
    seq.num_tokens_sent = seq.num_output_tokens
    return RequestDelta(
        request_id=seq.request_id,
        text=text,
        token_ids=new_tokens,
        finished=finished,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens or 0,
        num_output_tokens=seq.num_output_tokens,
        final=make_output(seq) if finished else None,
        index=seq.index,
        logprobs=new_logprobs,
        embedding=seq.embedding if finished else None,
    )


def make_output(seq: Sequence) -> RequestOutput:
    """The whole result of a finished ``seq``."""
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=list(seq.prompt_token_ids),
        token_ids=seq.output_token_ids,
        text=seq.text,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        metrics=RequestMetrics(
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_output_tokens=seq.num_output_tokens,
            num_preemptions=seq.num_preemptions,
        ),
        index=seq.index,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        embedding=seq.embedding,
    )
