"""Redis commands and round trips per request, by pipeline process, from a ``redis-cli monitor`` capture.

The request path's Redis traffic, measured: capture a few seconds of a pipeline benchmark run
(``python -m benchmarks.pipeline --rates 50 ...`` on its private Redis, ``timeout 5 redis-cli -p 26692 monitor >
FILE`` once the log says "50 req/s for"), then ``python -m benchmarks.redis_trips FILE``.

- A round trip: consecutive commands of one client connection less than ``gap_s`` (250 µs) apart, and everything
  from a ``MULTI`` to its ``EXEC``. ``monitor`` prints a pipeline's commands back to back, and separate calls of one
  connection at least a round trip and the caller's work apart (milliseconds on the loaded box). A 50 µs gap (the
  default until 2026-11-27) split pipelines whose status records (1 KB each) take ``monitor`` ~100 µs to print,
  and so counted records riding another write as round trips of their own.
- A connection belongs to the worker when it sends stream appends or pickup reads (``XADD``, ``XRANGE``,
  ``EXISTS``), to the result service when it reads streams (``XREAD``, ``XREVRANGE``), otherwise to ingress (its
  ``queued`` status record) or the rest.
- Requests: the ``done`` events appended in the capture. A capture cut mid-request counts its commands but maybe
  not its ``done``, so figures are close to, not exactly, per request; round trips that carry stream appends
  depend on the load (one per engine step), so compare runs of similar load.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

_LINE = re.compile(r'^(?P<t>\d+\.\d+) \[\d+ (?P<client>[^\]]+)\] "(?P<cmd>[A-Za-z]+)"(?P<rest>.*)$')
_DONE = '\\"type\\":\\"done\\"'  # a done event's JSON as monitor quotes it


@dataclass
class ProcessTraffic:
    """One process's commands (by name) and round trips (by the set of commands each carried)."""

    commands: Counter[str] = field(default_factory=Counter)
    trips: Counter[tuple[str, ...]] = field(default_factory=Counter)

    @property
    def n_commands(self) -> int:
        return sum(self.commands.values())

    @property
    def n_trips(self) -> int:
        return sum(self.trips.values())


@dataclass
class Traffic:
    requests: int
    by_process: dict[str, ProcessTraffic]


def _process(commands: Counter[str]) -> str:
    if commands["XADD"] or commands["XRANGE"] or commands["EXISTS"]:
        return "worker"
    if commands["XREAD"] or commands["XREVRANGE"]:
        return "result-service"
    return "ingress/other"


def summarize(lines: Iterable[str], gap_s: float = 250e-6) -> Traffic:
    """Commands and round trips of each process in a ``redis-cli monitor`` capture."""
    rows: list[tuple[float, str, str]] = []
    per_client: defaultdict[str, Counter[str]] = defaultdict(Counter)
    requests = 0
    for line in lines:
        match = _LINE.match(line)
        if match is None:
            continue  # "OK", or a line cut by the capture's end
        cmd = match["cmd"].upper()
        rows.append((float(match["t"]), match["client"], cmd))
        per_client[match["client"]][cmd] += 1
        requests += cmd == "XADD" and _DONE in match["rest"]
    owner = {client: _process(commands) for client, commands in per_client.items()}
    traffic: defaultdict[str, ProcessTraffic] = defaultdict(ProcessTraffic)
    open_trips: dict[str, tuple[float, list[str]]] = {}  # client -> (time of its last command, the trip's commands)
    in_multi: set[str] = set()  # clients between MULTI and EXEC: one round trip whatever the gaps

    def close(client: str) -> None:
        _, commands = open_trips.pop(client)
        traffic[owner[client]].trips[tuple(sorted(set(commands)))] += 1

    for t, client, cmd in rows:
        traffic[owner[client]].commands[cmd] += 1
        last = open_trips.get(client)
        if last is not None and (client in in_multi or t - last[0] <= gap_s):
            last[1].append(cmd)
            open_trips[client] = (t, last[1])
        else:
            if last is not None:
                close(client)
            open_trips[client] = (t, [cmd])
        if cmd == "MULTI":
            in_multi.add(client)
        elif cmd in ("EXEC", "DISCARD"):
            in_multi.discard(client)
    for client in list(open_trips):
        close(client)
    return Traffic(requests, dict(traffic))


def _trip_kind(commands: tuple[str, ...]) -> str:
    kinds = set(commands)
    if "XRANGE" in kinds:
        return "pickup reads"
    if "XADD" in kinds:
        return "stream appends (and records)"
    if kinds <= {"SET"}:
        return "status records only"
    return " ".join(commands)


def report(traffic: Traffic) -> str:
    n = max(traffic.requests, 1)
    out = [f"requests (done events in the capture): {traffic.requests}"]
    total_commands = sum(p.n_commands for p in traffic.by_process.values())
    total_trips = sum(p.n_trips for p in traffic.by_process.values())
    out.append(f"all processes: {total_commands / n:.2f} commands, {total_trips / n:.2f} round trips per request")
    for name in sorted(traffic.by_process):
        proc = traffic.by_process[name]
        commands = ", ".join(f"{cmd} {k / n:.2f}" for cmd, k in proc.commands.most_common())
        out.append(f"{name}: {proc.n_commands / n:.2f} commands ({commands}), {proc.n_trips / n:.2f} round trips")
        kinds: Counter[str] = Counter()
        for commands_of_trip, k in proc.trips.items():
            kinds[_trip_kind(commands_of_trip)] += k
        out.extend(f"    {k / n:.2f} round trips: {kind}" for kind, k in kinds.most_common(6))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("capture", help="a redis-cli monitor capture")
    parser.add_argument("--gap-us", type=float, default=250.0, help="commands closer than this are one pipeline")
    args = parser.parse_args(argv)
    with open(args.capture, errors="replace") as capture:
        print(report(summarize(capture, args.gap_us * 1e-6)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
