"""Who wrote each stream entry, under which owner epoch: the attribution half of the nemesis run's history.

Two sources, best first:

* **the entry's own fields**: with fencing, a worker writes its id (``w``) and the owner epoch it holds
  (``epoch``) into every stream entry beside the event;
* **Redis's command log** (``MONITOR`` on the primary, kept by ``redis-cli monitor`` for the whole run) where the
  entries carry neither (the code before fencing). Each worker runs in a network namespace of its own, so the
  client address of a command names the worker that sent it. A worker's pick-up reads the stream (``XRANGE`` in
  the pick-up round trip): each such read from a worker begins a new owner epoch of that stream, numbered in the
  order Redis executed them. An ``XADD`` is replayed as Redis applied it (an explicit id must exceed the stream's
  last one, else it is refused), and an accepted one is attributed to its sender's latest epoch of that stream,
  together with the newest epoch any worker had begun by then (an append of an older epoch after a newer one
  began is a zombie's).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from benchmarks.nemesis_check import Entry
from schemas import STREAM_FIELD, parse_stream_event, seq_from_entry_id

WRITER_FIELD = "w"
EPOCH_FIELD = "epoch"

_LINE = re.compile(r"^(\d+\.\d+) \[\d+ ([^\]]+)\] (.*)$")
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b", "\\": b"\\", '"': b'"'}


@dataclass(frozen=True)
class MonitorCall:
    """One command of the log: when, from which client address (``ip`` of ``ip:port``; ``lua`` inside a script)."""

    time: float
    client: str
    args: tuple[str, ...]


def _unquote(text: str) -> str:
    """One argument as Redis's MONITOR quotes it (``sdscatrepr``: ``\\xHH`` for bytes it cannot print)."""
    if "\\" not in text:
        return text
    out, i = bytearray(), 0
    while i < len(text):
        char = text[i]
        if char == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "x" and i + 3 < len(text):
                out.append(int(text[i + 2 : i + 4], 16))
                i += 4
                continue
            out += _ESCAPES.get(nxt, nxt.encode())
            i += 2
            continue
        out += char.encode()
        i += 1
    return out.decode("utf-8", errors="replace")


def parse_monitor_line(line: str) -> MonitorCall | None:
    """A ``MONITOR`` line (``1700000000.123456 [0 10.0.0.5:41234] "xadd" "k" ...``), or None for any other line."""
    match = _LINE.match(line.rstrip("\n"))
    if match is None:
        return None
    client = match.group(2).rsplit(":", 1)[0] if ":" in match.group(2) else match.group(2)
    return MonitorCall(float(match.group(1)), client, tuple(_unquote(a) for a in _ARG.findall(match.group(3))))


@dataclass
class _Stream:
    top: int = -1  # the last seq Redis holds
    epochs: int = 0  # owner epochs begun (worker pick-ups)
    holding: dict[str, int] = field(default_factory=dict)  # writer -> its latest epoch
    entries: dict[int, tuple[str, int, int]] = field(default_factory=dict)  # seq -> (writer, epoch, newest then)
    times: dict[int, float] = field(default_factory=dict)  # seq -> when Redis applied its append


class CommandLog:
    """Replays the ``XRANGE`` and ``XADD`` commands workers sent, in Redis's order, into per-seq attributions.

    ``writers`` maps a worker's client address to its name; commands from other addresses (ingress, the relays,
    this harness) are not a worker's and are skipped, as are streams not under ``stream_prefix``. Appends made
    inside a Lua script (client ``lua``: fenced appends) are replayed too, under the writer ``lua``: their entries
    name their writer themselves."""

    def __init__(self, writers: dict[str, str], stream_prefix: str) -> None:
        self.writers = writers
        self.prefix = stream_prefix
        self.streams: dict[str, _Stream] = {}
        self.refused_appends = 0  # appends Redis refused as already present (a retry, or a second writer)

    def feed(self, calls: Iterable[MonitorCall]) -> None:
        for call in calls:
            writer = "lua" if call.client == "lua" else self.writers.get(call.client)
            if writer is None or len(call.args) < 2 or not call.args[1].startswith(self.prefix):
                continue
            command = call.args[0].lower()
            if command == "xrange":
                stream = self.streams.setdefault(call.args[1], _Stream())
                stream.epochs += 1
                stream.holding[writer] = stream.epochs
            elif command == "xadd" and len(call.args) >= 3:
                self._append(self.streams.setdefault(call.args[1], _Stream()), writer, call.args[2], call.time)

    def _append(self, stream: _Stream, writer: str, entry_id: str, at: float) -> None:
        try:
            seq = seq_from_entry_id(entry_id)
        except ValueError:
            return
        if seq <= stream.top:
            self.refused_appends += 1
            return
        stream.top = seq
        stream.entries[seq] = (writer, stream.holding.get(writer, 0), stream.epochs)
        stream.times[seq] = at

    def attribution(self, key: str, seq: int) -> tuple[str, int, int] | None:
        """(writer, epoch, newest epoch begun by then) of the entry ``seq`` of stream ``key``, when logged."""
        stream = self.streams.get(key)
        return None if stream is None else stream.entries.get(seq)

    def longest_pauses(self, windows: list[tuple[float, float, str]], writers: dict[str, set[str]]) -> list[float]:
        """For each window (start, end, faulted worker) and each stream appended to on both sides of its start
        whose writers (``writers``: stream key -> names) do not include the faulted worker: the longest time
        between two appends that reaches into the window. What a rebalance costs the streams it should spare."""
        pauses = []
        for start, end, faulted in windows:
            for key, stream in self.streams.items():
                if faulted in writers.get(key, set()):
                    continue
                times = sorted(stream.times.values())
                if not times or times[0] >= start or times[-1] <= start:
                    continue
                gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
                if gaps:
                    pauses.append(max(gaps))
        return pauses

    def feed_file(self, lines: Iterable[str]) -> None:
        """The lines of a ``redis-cli monitor`` output; only ``xadd`` and ``xrange`` lines are parsed."""
        self.feed(
            call
            for line in lines
            if '"xadd"' in line or '"xrange"' in line or '"XADD"' in line or '"XRANGE"' in line
            if (call := parse_monitor_line(line)) is not None
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def entries_of(key: str, raw: list[tuple[bytes, dict[bytes, bytes]]], log: CommandLog | None) -> list[Entry]:
    """A stream's ``XRANGE`` reply as checker entries: writer and epoch from the entry's fields when it carries
    them, else from the command log (when given)."""
    entries = []
    for entry_id, fields in raw:
        values = {_text(k): _text(v) for k, v in fields.items()}
        event = parse_stream_event(values[STREAM_FIELD])
        finish = getattr(event, "finish_reason", None)
        entry = Entry(seq=event.seq, type=event.type, finish_reason=finish)
        if EPOCH_FIELD in values:
            entry.writer, entry.epoch = values.get(WRITER_FIELD), int(values[EPOCH_FIELD])
        elif log is not None and (found := log.attribution(key, seq_from_entry_id(entry_id))) is not None:
            entry.writer, entry.epoch, entry.newest_epoch = found
        entries.append(entry)
    return entries
