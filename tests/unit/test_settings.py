"""Settings come from SLUICEGATE_* variables, split by concern so each service reads only its own class, and
docs/configuration.md documents every one of them."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from sluicegate.settings import (
    AdmissionSettings,
    BatchServiceSettings,
    EngineSettings,
    IngressSettings,
    RouterSettings,
    Settings,
    SettingsBase,
    UsageRollupSettings,
    WorkerSettings,
    settings_table_markdown,
)
from sluicegate.settings.reference import CONCERNS, SERVICES, own_fields

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

#: The concerns that one service alone may read: its own class's fields and the concern beside them.
SERVICE_ONLY: dict[type[SettingsBase], tuple[type[SettingsBase], ...]] = {
    IngressSettings: (IngressSettings, AdmissionSettings),
    WorkerSettings: (WorkerSettings, EngineSettings),
    RouterSettings: (RouterSettings, UsageRollupSettings),
    BatchServiceSettings: (BatchServiceSettings,),
}

#: For each service in SERVICE_ONLY, a variable of its own with a value its class refuses.
BAD_OWN_VALUE = {
    IngressSettings: ("SLUICEGATE_MAX_BODY_BYTES", "1", "max_body_bytes"),
    WorkerSettings: ("SLUICEGATE_MAX_NUM_SEQS", "0", "max_num_seqs"),
    RouterSettings: ("SLUICEGATE_ROUTER_METRICS_PORT", "70000", "router_metrics_port"),
    BatchServiceSettings: ("SLUICEGATE_BATCH_CHUNK_SIZE", "0", "batch_chunk_size"),
}

SERVICE_CLASSES = [cls for _, cls in SERVICES]


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


def test_every_field_is_declared_by_exactly_one_concern_of_the_reference() -> None:
    declared = [name for _, cls in CONCERNS for name in own_fields(cls)]
    assert sorted(declared) == sorted(Settings.model_fields)


def test_the_whole_settings_stand_in_for_every_service() -> None:
    # The command line and tests pass one whole Settings wherever a service's class is asked for.
    assert all(issubclass(Settings, cls) for cls in SERVICE_CLASSES)


@pytest.mark.parametrize("service", SERVICE_CLASSES, ids=lambda cls: cls.__name__)
def test_a_service_carries_no_field_that_only_another_service_reads(service: type[SettingsBase]) -> None:
    for owner, concerns in SERVICE_ONLY.items():
        if owner is service:
            continue
        theirs = {name for concern in concerns for name in own_fields(concern)}
        assert not theirs & set(service.model_fields), f"{service.__name__} carries {owner.__name__}'s fields"


def test_the_ingress_has_no_engine_field_and_the_worker_no_ingress_field() -> None:
    assert not set(own_fields(EngineSettings)) & set(IngressSettings.model_fields)
    ingress_only = set(own_fields(IngressSettings)) | set(own_fields(AdmissionSettings))
    assert not ingress_only & set(WorkerSettings.model_fields)
    assert "api_keys" not in WorkerSettings.model_fields  # nor the public API's keys


@pytest.mark.parametrize("owner", list(BAD_OWN_VALUE), ids=lambda cls: cls.__name__)
def test_a_bad_variable_stops_only_the_services_that_read_it(
    owner: type[SettingsBase], monkeypatch: pytest.MonkeyPatch
) -> None:
    variable, value, field = BAD_OWN_VALUE[owner]
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError, match=field):
        owner()
    with pytest.raises(ValidationError, match=field):
        Settings()
    for service in SERVICE_CLASSES:
        if service is not owner:
            service()  # reads its own variables and ignores the other's


def test_helpers_keep_their_meaning() -> None:
    settings = Settings(served_models=" a, ,b ", request_record_ttl_s=10, stream_ttl_s=5)
    assert settings.served_model_names == frozenset({"a", "b"})
    assert settings.stream_token_lifetime_s == 15
