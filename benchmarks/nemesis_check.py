"""The nemesis run's checker: reads the history of every request (its stream entries, attributed to a writer and
an owner epoch, what its client received, its final results on Kafka) and says what went wrong, request by
request, in words.

A history is plain data (:class:`History`, a pydantic model, so a run's history is kept as JSON and checked
again later: ``python -m benchmarks.nemesis_check history.json``). The rules:

* **finished exactly once**: the stream ends with exactly one ``done`` or ``error``, and nothing follows it. A
  stream with none is *lost*, unless the request's reader lease lapsed (its relaying ingress died): the worker
  may then drop it, and it counts as cancelled. A ``done`` with ``finish_reason: abort`` counts as cancelled.
* **every seq once**: the stream's ``seq`` run 0..n with none twice and none missing, and a client that sees
  ``seq`` numbers (WebSocket with resume) received none twice.
* **one owner at a time**: read in ``seq`` order, the owner epoch never goes down (no entry of an older epoch
  after one of a newer), one epoch has one writer, and no owner continues a stream that a zombie appended to
  after that owner's pick-up (the epochs still rise in ``seq`` order, but the owner continues from text that is
  not in the stream). A zombie's append that no such owner follows (it lost the partition again before writing)
  leaves one writer's text: it is counted (``zombie_streams``), not a failure; fencing refuses it.
  Entries without an epoch cannot be judged: they are counted as *unattributed*, never passed silently.

Seeded sampled requests restart their random generator at a resume point, so their text is not compared with a
clean run: only the rules above apply to them, as to every request.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

ClientKind = Literal["openai_sse", "websocket", "native", "kafka_native", "batch"]
FindingKind = Literal["lost", "duplicated", "gap", "mixed", "client_lost", "client_duplicated", "no_result"]
Outcome = Literal["finished", "cancelled", "failed", "lost"]

TERMINAL = ("done", "error")


class Entry(BaseModel):
    """One stream entry as stored (in stream order), with who wrote it under which owner epoch, when known."""

    seq: int = Field(ge=0)
    type: str
    finish_reason: str | None = None
    writer: str | None = None
    epoch: int | None = None
    newest_epoch: int | None = Field(
        None, description="The newest owner epoch begun when this entry was written (known from a command log only)."
    )


class RequestHistory(BaseModel):
    """Everything the run knows about one accepted request."""

    request_id: str
    client: ClientKind
    sampled: bool = False
    lease_lapsed: bool = Field(False, description="The reader lease the request named lapsed (its ingress died).")
    entries: list[Entry] = Field(default_factory=list)
    received_seqs: list[int] | None = Field(None, description="Seqs a seq-seeing client received, in order.")
    client_finished: bool | None = Field(None, description="Whether the client saw the request's end; None: n/a.")
    results: int | None = Field(None, description="Final results for it on llm.results; None: not read.")


class History(BaseModel):
    """A run's requests, and where their entries' writers and epochs came from."""

    attribution: Literal["fields", "monitor", "none"] = "fields"
    requests: list[RequestHistory] = Field(default_factory=list)


class Finding(BaseModel):
    """One thing wrong with one request, said plainly."""

    request_id: str
    kind: FindingKind
    detail: str


class Verdict(BaseModel):
    """The counts the run reports, and every finding behind them."""

    requests: int = 0
    outcomes: dict[str, int] = Field(default_factory=dict)
    by_client: dict[str, int] = Field(default_factory=dict)
    lost: int = 0
    duplicated: int = 0
    mixed: int = 0
    gaps: int = 0
    mixed_sampled: int = 0
    zombie_streams: int = 0
    unattributed_entries: int = 0
    result_duplicates: int = 0
    findings: list[Finding] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def account(self, limit: int = 20) -> str:
        """The findings, one line each (the first ``limit``), for a report or an assertion message."""
        lines = [f"{f.request_id}: {f.kind}: {f.detail}" for f in self.findings[:limit]]
        if len(self.findings) > limit:
            lines.append(f"... and {len(self.findings) - limit} more")
        return "\n".join(lines)


def outcome_of(request: RequestHistory) -> Outcome:
    """How the request ended, by its stream's first terminal entry."""
    terminal = next((e for e in request.entries if e.type in TERMINAL), None)
    if terminal is None:
        return "cancelled" if request.lease_lapsed else "lost"
    if terminal.type == "error":
        return "failed"
    return "cancelled" if terminal.finish_reason == "abort" else "finished"


def _stream_findings(request: RequestHistory) -> list[Finding]:
    rid, entries, found = request.request_id, request.entries, []
    seqs = [e.seq for e in entries]
    twice = sorted(s for s, n in Counter(seqs).items() if n > 1)
    if twice:
        found.append(Finding(request_id=rid, kind="duplicated", detail=f"seq {twice} stored more than once"))
    terminals = [i for i, e in enumerate(entries) if e.type in TERMINAL]
    if len(terminals) > 1:
        ends = ", ".join(f"{entries[i].type} at seq {entries[i].seq}" for i in terminals)
        found.append(Finding(request_id=rid, kind="duplicated", detail=f"{len(terminals)} ends: {ends}"))
    elif terminals and terminals[0] != len(entries) - 1:
        after = len(entries) - 1 - terminals[0]
        found.append(Finding(request_id=rid, kind="duplicated", detail=f"{after} entries after its end"))
    if not terminals and not request.lease_lapsed:
        last = f"last seq {entries[-1].seq}" if entries else "no entries"
        found.append(Finding(request_id=rid, kind="lost", detail=f"never finished ({last})"))
    missing = sorted(set(range(max(seqs, default=-1) + 1)) - set(seqs))
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        found.append(Finding(request_id=rid, kind="gap", detail=f"{len(missing)} seqs missing: {shown}"))
    return found


def _mixing(request: RequestHistory) -> Finding | None:
    """The first place the stream's owner epoch goes back, one epoch shows two writers, or an owner continues a
    stream that a zombie appended to after that owner's pick-up."""
    newest: Entry | None = None
    newest_epoch = -1
    writers: dict[int, str] = {}
    # Entries written by an older epoch once a newer one had begun (zombie appends), with that newest epoch.
    stale: list[tuple[Entry, int]] = []
    for entry in request.entries:
        if entry.epoch is None:
            continue
        for old, begun in stale:  # this entry's owner had read the stream before ``old`` was appended to it
            if old.epoch is not None and old.epoch < entry.epoch <= begun:
                detail = (
                    f"seq {entry.seq} by {entry.writer} (epoch {entry.epoch}) continues a stream that seq "
                    f"{old.seq} by {old.writer} (epoch {old.epoch}) was appended to after epoch {entry.epoch} began"
                )
                return Finding(request_id=request.request_id, kind="mixed", detail=detail)
        if entry.newest_epoch is not None and entry.epoch < entry.newest_epoch:
            stale.append((entry, entry.newest_epoch))
        if entry.writer is not None:
            other = writers.setdefault(entry.epoch, entry.writer)
            if other != entry.writer:
                detail = f"epoch {entry.epoch} written by {other} and by {entry.writer} (seq {entry.seq})"
                return Finding(request_id=request.request_id, kind="mixed", detail=detail)
        if newest is not None and entry.epoch < newest_epoch:
            detail = (
                f"seq {entry.seq} by {entry.writer} (epoch {entry.epoch}) after seq {newest.seq} by "
                f"{newest.writer} (epoch {newest.epoch})"
            )
            return Finding(request_id=request.request_id, kind="mixed", detail=detail)
        if entry.epoch >= newest_epoch:  # the latest entry of the newest epoch, for the account
            newest, newest_epoch = entry, entry.epoch
    return None


def _client_findings(request: RequestHistory) -> list[Finding]:
    rid, found = request.request_id, []
    if request.received_seqs is not None:
        twice = sorted(s for s, n in Counter(request.received_seqs).items() if n > 1)
        if twice:
            found.append(Finding(request_id=rid, kind="client_duplicated", detail=f"client received seq {twice} again"))
    ended = any(e.type in TERMINAL for e in request.entries)
    if request.client_finished is False and ended:
        found.append(Finding(request_id=rid, kind="client_lost", detail=f"{request.client} client never saw the end"))
    if request.results == 0 and ended:
        found.append(Finding(request_id=rid, kind="no_result", detail="no final result on llm.results"))
    return found


def check(history: History) -> Verdict:
    """Every rule of the module docstring over every request of ``history``."""
    verdict = Verdict(requests=len(history.requests))
    outcomes: Counter[str] = Counter()
    clients: Counter[str] = Counter()
    for request in history.requests:
        outcomes[outcome_of(request)] += 1
        clients[request.client] += 1
        found = _stream_findings(request)
        mixed = _mixing(request)
        if mixed is not None:
            found.append(mixed)
            verdict.mixed += 1
            verdict.mixed_sampled += request.sampled
        verdict.zombie_streams += any(
            e.newest_epoch is not None and e.epoch is not None and e.epoch < e.newest_epoch for e in request.entries
        )
        found += _client_findings(request)
        kinds = {f.kind for f in found}
        verdict.lost += bool(kinds & {"lost", "client_lost"})
        verdict.duplicated += bool(kinds & {"duplicated", "client_duplicated"})
        verdict.gaps += "gap" in kinds
        verdict.unattributed_entries += sum(e.epoch is None for e in request.entries)
        if request.results is not None:
            verdict.result_duplicates += max(0, request.results - 1)
        verdict.findings += found
    verdict.outcomes = dict(outcomes)
    verdict.by_client = dict(clients)
    return verdict


def main() -> int:
    parser = argparse.ArgumentParser(description="Check a nemesis run's history (JSON).")
    parser.add_argument("history", type=Path)
    args = parser.parse_args()
    verdict = check(History.model_validate_json(args.history.read_text()))
    print(verdict.model_dump_json(indent=1, exclude={"findings"}))
    if not verdict.ok:
        print(verdict.account(limit=100), file=sys.stderr)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
