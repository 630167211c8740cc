"""The local broker's listener kind is fixed when its storage is formatted (SCRAM users go in then): data formatted
for one kind refuses to serve the other with a clear error, and a SASL_SSL stack hands out its client variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.backbone.broker_security import BrokerSecurity, check_security, formatted_security, mark_formatted
from cli.stack.layout import DevStackError, StackLayout


def formatted(tmp_path: Path, security: BrokerSecurity | None) -> StackLayout:
    layout = StackLayout(tmp_path, 19500, 19510)
    (layout.kafka_dir / "data").mkdir(parents=True)
    (layout.kafka_dir / "data" / "meta.properties").write_text("version=1\n")
    mark_formatted(layout, security)
    return layout


def test_data_formatted_plaintext_refuses_a_sasl_ssl_listener(tmp_path: Path) -> None:
    layout = formatted(tmp_path, None)
    check_security(layout, "plaintext")
    with pytest.raises(DevStackError, match="formatted for a plaintext listener, not sasl_ssl"):
        check_security(layout, "sasl_ssl")


def test_data_formatted_sasl_ssl_refuses_a_plaintext_listener(tmp_path: Path) -> None:
    layout = formatted(tmp_path, BrokerSecurity.of(StackLayout(tmp_path, 19500, 19510)))
    assert formatted_security(layout) == "sasl_ssl"
    with pytest.raises(DevStackError, match="formatted for a sasl_ssl listener, not plaintext"):
        check_security(layout, "plaintext")


def test_a_new_folder_takes_either(tmp_path: Path) -> None:
    layout = StackLayout(tmp_path, 19500, 19510)
    check_security(layout, "sasl_ssl")
    check_security(layout, "plaintext")
    assert formatted_security(layout) == "plaintext"


def test_the_client_variables_name_the_service_user_and_its_files(tmp_path: Path) -> None:
    security = BrokerSecurity(tmp_path / "security")
    env = security.env("127.0.0.1:19500")
    assert env["SLUICEGATE_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["SLUICEGATE_KAFKA_SASL_USERNAME"] == "sluicegate"
    assert env["SLUICEGATE_KAFKA_SASL_PASSWORD_FILE"] == str(tmp_path / "security" / "sluicegate.password")
    assert env["SLUICEGATE_KAFKA_SSL_CAFILE"] == str(tmp_path / "security" / "ca.pem")
    assert "SLUICEGATE_KAFKA_SASL_PASSWORD" not in env  # the secret stays in its file


def test_the_broker_denies_what_no_acl_allows_only_when_asked(tmp_path: Path) -> None:
    security = BrokerSecurity(tmp_path)
    security.password_file("admin").write_text("pw\n")
    default = security.server_properties().splitlines()
    assert "allow.everyone.if.no.acl.found=true" in default and "super.users=User:admin;User:ANONYMOUS" in default
    denying = security.server_properties(deny_without_acl=True).splitlines()
    assert "allow.everyone.if.no.acl.found=false" in denying
    assert "allow.everyone.if.no.acl.found=true" not in denying
