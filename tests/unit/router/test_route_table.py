"""The routing table the router and the batch worker resolve pipeline requests through: a route resolves to one
of its versions, sticky per tenant or per the request's ``user``, short prompts take the fast path (counted
with a real ``tokenizers`` tokenizer), it reloads on edit, and keeps the last good routes when an edit is
refused. (Rollbacks shared through Redis: tests/integration/test_model_routes.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from router.route_table import RouteTable
from router.routes import RoutesError
from router.versions import rendezvous
from schemas import ChatMessage, InferenceRequest

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


def _request(
    model: str, tenant: str, n: int = 0, *, prompt: str | list[int] = "hi", user: str | None = None
) -> InferenceRequest:
    return InferenceRequest(request_id=f"req-{tenant}-{n}", model=model, prompt=prompt, tenant=tenant, user=user)


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


async def test_refresh_picks_up_edits_and_keeps_last_good(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    _write(path, _SPLIT)
    table = RouteTable(path)
    _write(path, _ONLY_B, bump_ns=10**9)
    assert (await table.refresh()).changed == {"chat"}
    assert {table.resolve(_request("chat", str(t))).version for t in range(20)} == {"tiny-b"}  # type: ignore[union-attr]
    _write(path, "routes: [oops", bump_ns=2 * 10**9)
    found = await table.refresh()
    assert found.changed is None and found.refused is not None and "not valid YAML" in found.refused
    assert table.resolve(_request("chat", "t")).version == "tiny-b"  # type: ignore[union-attr]


async def test_an_empty_file_caught_mid_write_does_not_drop_the_routes(tmp_path: Path) -> None:
    """A reload that reads the file between a writer's truncate and its write sees it empty: the routes in
    force stay, and the finished write is read at the next check (CI once caught the old swap-in of no routes)."""
    path = tmp_path / "routes.yaml"
    _write(path, _SPLIT)
    table = RouteTable(path)
    _write(path, "", bump_ns=10**9)
    found = await table.refresh()
    assert found.changed is None and found.refused is None
    assert table.resolve(_request("chat", "t")) is not None
    _write(path, _ONLY_B, bump_ns=2 * 10**9)
    assert (await table.refresh()).changed == {"chat"}
    assert table.resolve(_request("chat", "t")).version == "tiny-b"  # type: ignore[union-attr]
    _write(path, "routes: {}\n", bump_ns=3 * 10**9)  # removing every route is said explicitly
    assert (await table.refresh()).changed == set() and table.resolve(_request("chat", "t")) is None


def test_a_route_sticky_per_user_keys_on_the_request_user(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    _write(path, _SPLIT.replace("  chat:\n", "  chat:\n    sticky: user\n"))
    table = RouteTable(path)
    weights = {"tiny-a": 50.0, "tiny-b": 50.0}
    for n in range(30):
        user = f"u{n}"
        # The same user from any tenant lands where the hash of the user puts them (as ingress keys it).
        got = {table.resolve(_request("chat", t, user=user)).version for t in ("t1", "t2", "t3")}  # type: ignore[union-attr]
        assert got == {rendezvous("chat", f"user:{user}", weights)}
    # No user: the tenant is the key.
    assert table.resolve(_request("chat", "t9")).version == rendezvous("chat", "t9", weights)  # type: ignore[union-attr]


def _word_tokenizer(folder: Path) -> Path:
    """A real tokenizer.json: one token per whitespace-separated word."""
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_short_prompts_take_the_fast_path_and_a_pinned_version_stays(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    tok = _word_tokenizer(tmp_path / "small")
    _write(
        path,
        "routes: {chat: {targets: [{model: big, weight: 1}], "
        f"fast_path: {{model: small, max_prompt_tokens: 4, tokenizer: {tok}}}}}}}",
    )
    table = RouteTable(path)
    assert table.routed(_request("chat", "t", prompt="one two three")).model == "small"
    assert table.routed(_request("chat", "t", prompt="one two three four")).model == "big"
    assert table.routed(_request("chat", "t", prompt=[5, 6, 7])).model == "small"  # ids count as they are
    chat = InferenceRequest(
        request_id="r-chat", model="chat", messages=[ChatMessage(role="user", content="a b c d e")], tenant="t"
    )
    assert table.routed(chat).model == "big"  # the messages' text is counted
    pinned = _request("big", "t", prompt="hi")
    assert table.routed(pinned) is pinned  # a version named directly is not moved


def test_a_bad_fast_path_tokenizer_is_refused_naming_the_route(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(
        "routes: {chat: {targets: [{model: big, weight: 1}], "
        f"fast_path: {{model: small, max_prompt_tokens: 4, tokenizer: {tmp_path}}}}}}}"
    )
    with pytest.raises(RoutesError, match=r"route 'chat': fast_path\.tokenizer: cannot load"):
        RouteTable(path)


def test_bad_file_at_start_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text("routes: {chat: {targets: []}}")
    with pytest.raises(RoutesError):
        RouteTable(path)
