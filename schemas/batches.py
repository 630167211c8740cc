"""The OpenAI Batch and Files API contracts: the file and batch objects ingress answers with, the input line a
batch file holds, and the output / error lines a finished batch's files hold.

Shaped exactly as OpenAI's, so the official ``openai`` SDK reads them unchanged; Sluicegate's one addition is
``eta_seconds`` on the batch object (the SDK keeps unknown fields).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: The endpoints a batch may target.
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
BATCH_ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
#: Statuses a batch never leaves.
BATCH_TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})

FilePurpose = Literal["batch", "batch_output"]


class _Api(BaseModel):
    """API objects: closed (a typo is an error, not a silently ignored field)."""

    model_config = ConfigDict(extra="forbid")


class FileObject(_Api):
    """``GET /v1/files/{id}``: an uploaded batch input, or a batch's output or error file."""

    id: str
    object: Literal["file"] = "file"
    bytes: int = Field(ge=0)
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None


class BatchRequestCounts(_Api):
    """How many of a batch's lines there are and how many ended each way."""

    total: int = Field(0, ge=0)
    completed: int = Field(0, ge=0)
    failed: int = Field(0, ge=0)


class InputTokensDetails(_Api):
    cached_tokens: int = Field(0, ge=0)


class OutputTokensDetails(_Api):
    reasoning_tokens: int = Field(0, ge=0)


class BatchUsage(_Api):
    """The tokens of the batch's lines that ran so far (OpenAI's batch ``usage``)."""

    input_tokens: int = Field(0, ge=0)
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = Field(0, ge=0)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = Field(0, ge=0)


class BatchError(_Api):
    """Why a batch failed validation, naming the line when one line is the cause."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(_Api):
    """The ``errors`` list object of a failed batch."""

    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class Batch(_Api):
    """``GET /v1/batches/{id}``. Every ``*_at`` is Unix seconds, None until the batch gets there."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: BatchEndpoint
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: Literal["24h"] = "24h"
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    usage: BatchUsage | None = Field(None, description="Tokens of the lines that ran so far; None before any did.")
    metadata: dict[str, str] | None = None
    eta_seconds: float | None = Field(
        None, description="Sluicegate: seconds until the batch should finish, from its backlog and the measured rate."
    )


class BatchInputLine(_Api):
    """One line of a batch input file."""

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: BatchEndpoint
    body: dict[str, Any]


class BatchResponse(_Api):
    """The HTTP answer a line got: status, the request id, and the body the online API would have returned."""

    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchLineError(_Api):
    """Why a line got no response at all (``batch_expired``, ``batch_cancelled``)."""

    code: str
    message: str


class BatchOutputLine(_Api):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str
    response: BatchResponse | None = None
    error: BatchLineError | None = None
