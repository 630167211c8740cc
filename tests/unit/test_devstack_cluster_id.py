"""The local broker's KRaft cluster id: never one the storage tool takes for an option."""

from __future__ import annotations

import base64
import shutil
import uuid
from pathlib import Path

import pytest
from needs import needs

from cli.backbone import kafka_broker
from cli.backbone.jars import ensure_jars, find_java
from cli.backbone.kafka_broker import Quorum, new_cluster_id
from cli.stack.layout import StackLayout
from sluicegate.settings import Settings

REPO_STATE = Path(__file__).resolve().parents[2] / ".sluicegate"
# 16 bytes whose URL-safe base64 text starts with "-" (the first 6 bits are 62).
DASH_BYTES = bytes([0xF8]) + bytes(15)


def test_new_cluster_ids_skip_those_starting_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = iter([uuid.UUID(bytes=DASH_BYTES), uuid.UUID(bytes=bytes(range(16)))])
    monkeypatch.setattr(kafka_broker.uuid, "uuid4", lambda: next(drawn))
    assert base64.urlsafe_b64encode(DASH_BYTES).decode().startswith("-")
    cluster_id = new_cluster_id()
    assert cluster_id == base64.urlsafe_b64encode(bytes(range(16))).rstrip(b"=").decode()


def test_new_cluster_ids_are_kafka_uuids() -> None:
    for _ in range(200):
        cluster_id = new_cluster_id()
        assert not cluster_id.startswith("-")
        assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


@needs(shutil.which("java") is not None, "java", "apt-get install default-jre-headless")
@needs(shutil.which("mvn") is not None or REPO_STATE.joinpath("kafka", "libs").exists(), "the broker jars")
def test_storage_formats_with_a_stored_id_that_starts_with_a_dash(tmp_path: Path) -> None:
    # A folder formatted before ids were checked may hold such an id; formatting must still take it as the id.
    jars = ensure_jars(StackLayout.of(Settings(state_dir=REPO_STATE)))
    layout = StackLayout.of(Settings(state_dir=tmp_path, kafka_port=29192, redis_port=29179))
    cluster_id = base64.urlsafe_b64encode(DASH_BYTES).rstrip(b"=").decode()
    kafka_broker._write_config(layout, Settings(), Quorum.single(layout))
    kafka_broker._format_storage(layout, find_java(), jars, cluster_id)
    meta = (layout.kafka_dir / "data" / "meta.properties").read_text()
    assert f"cluster.id={cluster_id}" in meta
