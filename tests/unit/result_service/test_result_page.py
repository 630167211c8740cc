"""The chat page's server-side defaults: which key may list ingress's models."""

from __future__ import annotations

from pathlib import Path

from result_service.page import _first_api_key


def test_first_key_from_the_environment_list() -> None:
    assert _first_api_key(" sg-one , sg-two", None) == "sg-one"


def test_first_usable_key_from_a_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(
        '# comment\n\n{"key_hash": "' + "0" * 64 + '", "tenant": "a"}\n{"key": "sg-json", "tenant": "b"}\nsg-bare\n'
    )
    assert _first_api_key("", keys) == "sg-json"


def test_no_key_at_all(tmp_path: Path) -> None:
    assert _first_api_key("", None) is None
    assert _first_api_key("", tmp_path / "missing") is None
    only_hashes = tmp_path / "keys"
    only_hashes.write_text('{"key_hash": "' + "0" * 64 + '"}\n')
    assert _first_api_key(" , ", only_hashes) is None
