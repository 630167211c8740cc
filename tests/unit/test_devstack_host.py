"""The local Kafka's client listener on another address of the machine (``SLUICEGATE_KAFKA_HOST``): bound and
advertised there on every node, controllers still on the loopback; a bad address is refused naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from cli.backbone.kafka_broker import Quorum, _write_config
from cli.backbone.kafka_cluster import cluster_bootstrap, node_layouts
from cli.stack.layout import StackLayout
from sluicegate.settings import Settings


def test_every_node_listens_and_advertises_on_the_kafka_host(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path, kafka_port=41000, redis_port=41010, kafka_host="10.241.0.1")
    nodes = node_layouts(StackLayout.of(settings), 3)
    assert cluster_bootstrap(nodes) == "10.241.0.1:41000,10.241.0.1:41002,10.241.0.1:41004"
    props = _write_config(nodes[1], settings, Quorum(2, "1@127.0.0.1:41001", 3, 2)).read_text()
    assert "listeners=PLAINTEXT://10.241.0.1:41002,CONTROLLER://127.0.0.1:41003" in props
    assert "advertised.listeners=PLAINTEXT://10.241.0.1:41002" in props
    assert StackLayout.of(Settings(state_dir=tmp_path)).bootstrap == "127.0.0.1:9092"


def test_a_kafka_host_that_is_not_an_address_names_the_setting() -> None:
    with pytest.raises(ValidationError, match="kafka_host"):
        Settings(kafka_host="not an address")
