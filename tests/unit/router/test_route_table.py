"""The router's routing table for Kafka-native requests: a route resolves to one of its versions, sticky per
tenant, reloads on edit, and keeps the last good routes when an edit is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from router.route_table import RouteTable
from router.routes import RoutesError
from schemas import InferenceRequest

_SPLIT = """
routes:
  chat:
    targets:
      - {model: tiny-a, weight: 50}
      - {model: tiny-b, weight: 50}
"""
_ONLY_B = """
routes:
  chat:
    targets:
      - {model: tiny-a, weight: 0}
      - {model: tiny-b, weight: 1}
"""


def _request(model: str, tenant: str, n: int = 0) -> InferenceRequest:
    return InferenceRequest(request_id=f"req-{tenant}-{n}", model=model, prompt="hi", tenant=tenant)


def _write(path: Path, text: str, bump_ns: int = 0) -> None:
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump_ns))


def test_route_resolves_sticky_per_tenant_and_versions_pass_through(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    _write(path, _SPLIT)
    table = RouteTable(path)
    chosen = {t: {table.resolve(_request("chat", t, n)).version for n in range(5)} for t in map(str, range(40))}  # type: ignore[union-attr]
    assert all(len(v) == 1 for v in chosen.values())  # sticky: one version per tenant
    assert set().union(*chosen.values()) == {"tiny-a", "tiny-b"}  # and the split uses both
    assert table.resolve(_request("tiny-a", "t")) is None  # a version is pinned, not routed


def test_refresh_picks_up_edits_and_keeps_last_good(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    _write(path, _SPLIT)
    table = RouteTable(path)
    _write(path, _ONLY_B, bump_ns=10**9)
    table.refresh()
    assert {table.resolve(_request("chat", str(t))).version for t in range(20)} == {"tiny-b"}  # type: ignore[union-attr]
    _write(path, "routes: [oops", bump_ns=2 * 10**9)
    table.refresh()
    assert table.resolve(_request("chat", "t")).version == "tiny-b"  # type: ignore[union-attr]


def test_bad_file_at_start_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text("routes: {chat: {targets: []}}")
    with pytest.raises(RoutesError):
        RouteTable(path)
