"""The local folder of one deployment: what a process keeps on its own disk when no other place is configured
(the local stack's Kafka and Redis, uploaded files, fetched LoRA adapters, downloaded models)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from .base import SettingsBase


class StateDirSettings(SettingsBase):
    """The folder that the defaults of other places are under."""

    state_dir: Path = Field(
        Path(".sluicegate"), description="Folder for the local stack: Kafka jars, data, logs, pid files."
    )
