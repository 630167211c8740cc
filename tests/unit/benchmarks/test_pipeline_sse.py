"""The pipeline benchmark's reader of streamed OpenAI completions: frames split anywhere across reads, the first
choice stamped as the first token, the request id from the completion id, tokens from the usage chunk."""

from __future__ import annotations

import json

from benchmarks.pipeline_load import Sample, _SseReader


def frame(chunk: object) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


def test_frames_split_across_reads() -> None:
    sample = Sample()
    reader = _SseReader(sample)
    token = {"id": "cmpl-abc123", "choices": [{"index": 0, "text": "", "logprobs": {}}], "usage": None}
    usage = {"id": "cmpl-abc123", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 8}}
    stream = frame(token) + frame(token) + frame(usage) + b"data: [DONE]\n\n"
    reader(b"", 1.0)  # the response head
    reader(stream[:10], 2.0)
    assert sample.first == 0.0  # half a frame is not a token
    cut = len(frame(token)) + 5  # the first frame and a few bytes of the second
    reader(stream[10:cut], 3.0)
    reader(stream[cut:], 4.0)
    assert (sample.accepted, sample.first, sample.done) == (1.0, 3.0, 4.0)
    assert sample.request_id == "abc123" and sample.tokens == 8 and sample.error is None


def test_an_error_chunk_is_the_sample_error() -> None:
    sample = Sample()
    reader = _SseReader(sample)
    reader(frame({"error": {"message": "timeout", "code": "timeout"}}) + b"data: [DONE]\n\n", 1.0)
    assert sample.error is not None and "timeout" in sample.error and sample.first == 0.0
