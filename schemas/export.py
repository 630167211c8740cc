"""Writes the JSON Schema of every message so producers in any language can validate theirs."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, TypeAdapter

from .adapters import LoRAAdapter
from .batches import Batch, BatchInputLine, BatchOutputLine, FileObject
from .control import CancelRequest, DeadLetter, FinalResult, RequestRecord, WorkerHeartbeat
from .events import StreamEvent
from .kv_events import KVCacheEvents, KVSnapshotRequest
from .relay import CLIENT_MESSAGE, NOTICE
from .requests import InferenceRequest
from .usage import UsageRecord

#: File stem -> the contract it describes.
EXPORTED: dict[str, type[BaseModel] | TypeAdapter] = {
    "InferenceRequest": InferenceRequest,
    "StreamEvent": TypeAdapter(StreamEvent),
    "CancelRequest": CancelRequest,
    "WorkerHeartbeat": WorkerHeartbeat,
    "KVCacheEvents": KVCacheEvents,
    "KVSnapshotRequest": KVSnapshotRequest,
    "FinalResult": FinalResult,
    "DeadLetter": DeadLetter,
    "RequestRecord": RequestRecord,
    "BatchInputLine": BatchInputLine,
    "BatchOutputLine": BatchOutputLine,
    "Batch": Batch,
    "FileObject": FileObject,
    "UsageRecord": UsageRecord,
    "LoRAAdapter": LoRAAdapter,
    "RelayClientMessage": CLIENT_MESSAGE,
    "RelayNotice": NOTICE,
}

#: Where the checked-in copies live.
JSON_DIR = Path(__file__).parent / "json"


def render_schemas() -> dict[str, str]:
    """File name -> JSON text of each schema, deterministic so the checked-in copy can be diffed."""
    rendered: dict[str, str] = {}
    for name, contract in EXPORTED.items():
        if isinstance(contract, TypeAdapter):
            schema = contract.json_schema(mode="validation")
        else:
            schema = contract.model_json_schema(mode="validation")
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": name, **schema}
        rendered[f"{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return rendered


def export_schemas(out_dir: Path) -> list[Path]:
    """Write every schema into ``out_dir`` (created if needed) and return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, text in render_schemas().items():
        path = out_dir / file_name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
