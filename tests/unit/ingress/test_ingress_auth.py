"""API keys: loading from the environment and a keys file, hashes only, and where a request presents one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ingress.auth import ApiKey, KeyRing, derived_tenant, hash_key, parse_keys_file, presented_key, require_admin
from sluicegate.api.errors import ApiError


def test_env_keys_get_derived_tenants_and_default_tiers() -> None:
    ring = KeyRing.load("sk-alpha-123, sk-beta-4567 ,", None)
    assert len(ring) == 2
    key = ring.lookup("sk-alpha-123")
    assert key is not None
    assert key.tenant == derived_tenant(hash_key("sk-alpha-123")) and key.tenant.startswith("key-")
    assert (key.default_tier, key.max_tier) == ("standard", "interactive")
    assert ring.lookup("sk-alpha-12") is None and ring.lookup("") is None


def test_keys_file_with_plain_and_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    lines = [
        "# team keys",
        "plain-key-0001",
        "",
        json.dumps({"key": "acme-key-0001", "tenant": "acme", "default_tier": "batch", "max_tier": "standard"}),
        json.dumps({"key_hash": hash_key("hashed-key-01"), "tenant": "beta"}),
    ]
    path.write_text("\n".join(lines))
    ring = KeyRing.load("", path)
    assert len(ring) == 3
    acme = ring.lookup("acme-key-0001")
    assert acme == ApiKey(key_hash=hash_key("acme-key-0001"), tenant="acme", default_tier="batch", max_tier="standard")
    assert ring.lookup("hashed-key-01").tenant == "beta"  # type: ignore[union-attr]
    assert ring.lookup("plain-key-0001") is not None


def test_only_hashes_are_kept_in_memory(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(json.dumps({"key": "very-secret-key", "tenant": "acme"}))
    ring = KeyRing.load("another-secret-key", path)
    dumped = repr(vars(ring)) + "".join(k.model_dump_json() for k in vars(ring)["_by_hash"].values())
    assert "very-secret-key" not in dumped and "another-secret-key" not in dumped


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"key": "k-000000001", "max_tier": "gold"}', "'max_tier'"),
        ('{"key": "k-000000001", "default_tier": "interactive", "max_tier": "batch"}', "above max_tier"),
        ('{"tenant": "x"}', "exactly one of 'key' and 'key_hash'"),
        ('{"key": "k-000000001", "tenant": "bad tenant"}', "'tenant'"),
        ("{broken", "line 2"),
        ("short", "at least 8"),
        # Each of these used to load, leaving a key nobody could use or a limit nobody set.
        ("sk-plain-1234  # ops", "may not contain spaces"),
        ('{"key": " sk-padded-1 "}', "may not contain spaces"),
        ('{"key": "k-000000001", "admin": "yes"}', "'admin'"),
        ('{"key": "k-000000001", "tokens_per_day": "100"}', "'tokens_per_day'"),
        ('{"key": "ok-key-00001", "tenant": "other"}', "the same key as line 1"),
    ],
)
def test_bad_keys_file_lines_name_line_and_problem(line: str, problem: str) -> None:
    with pytest.raises(ValueError, match="keys line 2") as info:
        parse_keys_file(["ok-key-00001", line], source="keys")
    assert problem in str(info.value)


def test_missing_keys_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        KeyRing.load("", tmp_path / "absent")


def test_presented_key_from_bearer_or_x_api_key() -> None:
    assert presented_key({"authorization": "Bearer sk-1"}) == "sk-1"
    assert presented_key({"authorization": "bearer  sk-2 "}) == "sk-2"
    assert presented_key({"x-api-key": "sk-3"}) == "sk-3"
    assert presented_key({"authorization": "Basic abc"}) is None
    assert presented_key({}) is None


def test_admin_keys_from_the_keys_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(
        json.dumps({"key": "ops-key-00001", "tenant": "ops", "admin": True})
        + "\n"
        + json.dumps({"key": "user-key-0001", "tenant": "acme"})
    )
    ring = KeyRing.load("plain-key-0001", path, "env-admin-key-01")
    assert ring.lookup("ops-key-00001").admin  # type: ignore[union-attr]
    assert ring.lookup("env-admin-key-01").admin  # type: ignore[union-attr]
    assert not ring.lookup("user-key-0001").admin  # type: ignore[union-attr]
    assert not ring.lookup("plain-key-0001").admin  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="SLUICEGATE_ADMIN_API_KEYS entry 1"):
        KeyRing.load("", None, "short")
    with pytest.raises(ValueError, match="line 1"):
        parse_keys_file([json.dumps({"key": "ops-key-00001", "admin": "yes please"})])


async def test_require_admin_refuses_other_keys_with_403() -> None:
    admin = ApiKey(key_hash=hash_key("ops-key-00001"), tenant="ops", admin=True)
    assert await require_admin(admin) is admin
    with pytest.raises(ApiError) as refused:
        await require_admin(ApiKey(key_hash=hash_key("user-key-0001"), tenant="acme"))
    assert refused.value.status == 403 and refused.value.body()["error"]["type"] == "permission_error"
