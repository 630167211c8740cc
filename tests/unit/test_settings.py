"""Settings come from SLUICEGATE_* variables and docs/configuration.md documents every one of them."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from sluicegate.settings import Settings, settings_table_markdown

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_env_prefix_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICEGATE_KAFKA_BOOTSTRAP", "k:1")
    monkeypatch.setenv("SLUICEGATE_TOPIC_PARTITIONS", "3")
    settings = Settings()
    assert settings.kafka_bootstrap == "k:1"
    assert settings.topic_partitions == 3


def test_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICEGATE_TOPIC_PARTITIONS", "0")
    with pytest.raises(ValidationError, match="topic_partitions"):
        Settings()


def test_configuration_reference_documents_every_setting() -> None:
    assert settings_table_markdown() in CONFIGURATION.read_text(), (
        "docs/configuration.md is stale: paste sluicegate.settings.settings_table_markdown() between the markers"
    )
