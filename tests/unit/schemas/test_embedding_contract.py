"""The embedding request contract: ``task: embed`` with optional ``pooling`` on ``InferenceRequest``, the vector in
the ``done`` event and the final result as base64 of little-endian float32."""

from __future__ import annotations

import base64
import struct

import pytest
from pydantic import ValidationError

from schemas import DoneEvent, InferenceRequest, Usage, decode_embedding, encode_embedding, parse_stream_event


def test_embed_requests_pool_last_by_default_and_generate_stays_the_default() -> None:
    plain = InferenceRequest(request_id="r1", model="m", prompt="hi")
    assert plain.task == "generate" and plain.embedding_pooling is None
    embed = InferenceRequest(request_id="r2", model="m", prompt=[1, 2], task="embed")
    assert embed.embedding_pooling == "last"
    mean = InferenceRequest.model_validate_json(embed.model_copy(update={"pooling": "mean"}).model_dump_json())
    assert mean.embedding_pooling == "mean"


@pytest.mark.parametrize(
    "fields",
    [
        {"task": "embed", "messages": [{"role": "user", "content": "hi"}]},
        {"task": "embed", "prompt": "hi", "sampling": {"n": 2}},
        {"task": "embed", "prompt": "hi", "guided": {"regex": "a+"}},
        {"prompt": "hi", "pooling": "mean"},
        {"task": "embed", "prompt": "hi", "pooling": "cls"},
        {"task": "classify", "prompt": "hi"},
    ],
)
def test_malformed_embed_requests_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        InferenceRequest.model_validate({"request_id": "r", "model": "m", **fields})


def test_the_vector_travels_as_base64_little_endian_float32() -> None:
    vector = [0.5, -0.25, 1.0 / 3.0]
    encoded = encode_embedding(vector)
    assert base64.b64decode(encoded) == struct.pack("<3f", *vector)
    assert decode_embedding(encoded) == list(struct.unpack("<3f", base64.b64decode(encoded)))
    usage = Usage(prompt_tokens=3, completion_tokens=0, total_tokens=3)
    done = DoneEvent(request_id="r", seq=0, finish_reason="stop", usage=usage, embedding=encoded)
    assert parse_stream_event(done.model_dump_json()) == done
    plain = DoneEvent(request_id="r", seq=0, finish_reason="stop", usage=usage)
    assert "embedding" not in plain.model_dump_json()  # a generation's done event reads as before
