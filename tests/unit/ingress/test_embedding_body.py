"""The ``/v1/embeddings`` body and response: every input shape OpenAI takes, ``dimensions`` and empty inputs
refused, one ``task: embed`` request per input, vectors as floats or as the worker's base64."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas import encode_embedding
from sluicegate.api.build import build_request
from sluicegate.api.embeddings import EmbeddingBody, embedding_response
from sluicegate.api.errors import ApiError


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_every_input_shape_is_one_embedding_each(given: object, inputs: list[object]) -> None:
    body = EmbeddingBody.model_validate({"model": "m", "input": given, "pooling": "mean", "user": "u1"})
    assert body.inputs() == inputs
    requests = [
        build_request(item, request_id=f"r{i}", tenant="t", tier="standard", trace=None, max_tokens=1)
        for i, item in enumerate(body.items())
    ]
    assert [r.prompt for r in requests] == inputs
    assert {(r.task, r.pooling, r.user) for r in requests} == {("embed", "mean", "u1")}


@pytest.mark.parametrize(
    "fields",
    [{"dimensions": 8}, {"input": ""}, {"input": []}, {"input": ["ok", ""]}, {"input": [[]]}, {"pooling": "cls"}],
)
def test_refused_bodies(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as caught:
        EmbeddingBody.model_validate({"model": "m", "input": "hi", **fields})
    if "dimensions" in fields:
        assert caught.value.errors()[0]["type"] == "unsupported"


def test_the_response_in_floats_or_base64() -> None:
    vectors = [encode_embedding([0.6, 0.8]), encode_embedding([1.0, 0.0])]
    floats = embedding_response("m", vectors, 7, "float")
    assert floats["data"] == [
        {"object": "embedding", "index": 0, "embedding": [pytest.approx(0.6), pytest.approx(0.8)]},
        {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]},
    ]
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and floats["model"] == "m"
    assert [d["embedding"] for d in embedding_response("m", vectors, 7, "base64")["data"]] == vectors
    with pytest.raises(ApiError):
        embedding_response("m", [None], 1, "float")
