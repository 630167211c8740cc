"""The Files and Batches API's shared ground: where files are stored, the Celery broker, the input limits, and a
batch's window. Ingress accepts files and batches and kicks the batch workers; the batch workers read the same
files and queue, so both read these (the batch workers' own pacing is in :mod:`.batch_service`)."""

from __future__ import annotations

from pydantic import Field

from .backbone import BackboneSettings
from .state_dir import StateDirSettings


class BatchApiSettings(BackboneSettings, StateDirSettings):
    """File storage (under the state folder by default), the broker (the Redis URL by default) and batch limits."""

    files_url: str = Field(
        "",
        description="Where uploaded and batch output files are stored: a folder or an fsspec URL (s3://..., "
        "memory://...); empty means <state_dir>/files.",
    )
    batch_broker_url: str = Field("", description="Celery broker of the batch workers; empty means the Redis URL.")
    batch_max_file_bytes: int = Field(
        200 * 1024 * 1024, ge=1024, description="Largest batch input file accepted (413 above), OpenAI's 200 MB."
    )
    batch_max_lines: int = Field(50_000, ge=1, description="Most lines a batch input file may hold (400 above).")
    batch_visibility_timeout_s: int = Field(
        30,
        ge=5,
        description="Seconds before the broker re-delivers a task whose batch worker died (kill -9) without acking.",
    )
    batch_window_s: int = Field(
        86400, ge=1, description='Length of the "24h" completion window, in seconds (shorter for tests and demos).'
    )
