"""``POST /v1/embeddings``: the body OpenAI's SDK sends and the response it reads.

Each input (a string, token ids, or a list of either) becomes one prefill-only request
(:class:`~sluicegate.api.bodies.EmbeddingInput`, ``task: embed`` on the wire) that the workers batch with generation;
their vectors come back base64-encoded (little-endian float32) in each request's ``done`` event and are answered
as floats or passed on as base64 (``encoding_format``). ``pooling`` (a vLLM-style extra: ``last``, the default for
decoder models, or ``mean``) picks how the final hidden states are pooled; vectors are L2-normalized. ``dimensions``
(shortened embeddings) is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, field_validator

from schemas import EndUser, Pooling, Tier, decode_embedding

from .bodies import EmbeddingInput
from .bodies.base import MODEL_DESCRIPTION, TOKEN_IDS_SCHEMA, Body, unsupported
from .deadlines import DeadlineField
from .errors import ApiError

#: Most inputs one call may embed (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048

_TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
InputField = Annotated[
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    | _TokenIds
    | Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)],
    WithJsonSchema(
        {
            "description": "Text, a list of texts, token ids, or a list of token-id lists (one embedding each).",
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "minItems": 1,
                    "maxItems": MAX_EMBEDDING_INPUTS,
                },
                TOKEN_IDS_SCHEMA,
                {"type": "array", "items": TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS},
            ],
        }
    ),
]


class EmbeddingBody(Body):
    """``POST /v1/embeddings``."""

    model: str = Field(min_length=1, max_length=256, description=MODEL_DESCRIPTION)
    input: InputField
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[
        int | None,
        WithJsonSchema({"type": "null", "description": "Shortened embeddings are not supported: leave it out."}),
    ] = None
    user: EndUser | None = None
    pooling: Pooling | None = Field(None, description="vLLM-style extra: last (default) or mean; L2-normalized.")
    priority: Tier | None = None
    deadline: DeadlineField | None = None  # as on the other endpoints; also the X-Request-Deadline header

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, value: int | None) -> int | None:
        if value is not None:
            raise unsupported("dimensions (shortened embeddings) is not supported; leave it out")
        return value

    def inputs(self) -> list[str | list[int]]:
        """Every input, one embedding each, in order."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]

    def items(self) -> list[EmbeddingInput]:
        """One request body per input."""
        return [
            EmbeddingInput(
                model=self.model,
                prompt=p,
                pooling=self.pooling or "last",
                priority=self.priority,
                user=self.user,
                deadline=self.deadline,
            )
            for p in self.inputs()
        ]


def embedding_response(
    model: str, vectors: list[str | None], prompt_tokens: int, encoding_format: str
) -> dict[str, Any]:
    """OpenAI's embeddings list, from each input's vector as the worker sent it (base64 float32, in a ``done``
    event or a final result), in input order; 500 for a worker that answered without a vector (one that does not
    know embedding requests)."""
    data = []
    for index, encoded in enumerate(vectors):
        if encoded is None:
            raise ApiError(500, "The worker answered an embedding request without a vector.", code="worker_error")
        vector: str | list[float] = decode_embedding(encoded) if encoding_format == "float" else encoded
        data.append({"object": "embedding", "index": index, "embedding": vector})
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}
