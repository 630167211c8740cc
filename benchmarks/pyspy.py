"""Sampling profiles of running Python processes with py-spy, one SVG flame graph per process, and a summary of
where each process's samples go.

``Profiles(out_dir, label, pids)`` is a context manager: on entry it starts ``py-spy record`` on every Python
process of ``pids`` (Kafka's JVM and ``redis-server`` are skipped: py-spy reads only CPython), on exit it stops
them with SIGINT, the signal on which py-spy writes its flame graph. py-spy samples from outside (it reads the
target's memory), so the profiled process runs unchanged; the samplers' own CPU lands on this machine's other
work, which the benchmark's CPU table does not count as the pipeline's.

``top_frames(svg)`` reads a flame graph back: the samples under each function, summed over its boxes (py-spy's
SVG titles every box ``name (file:line) (N samples, P%)``; a function that calls itself counts more than once).
``self_frames(svg)`` counts only the samples in which a function was the innermost frame (its own time, where the
CPU went: a socket write shows up there, the request handler above it does not). ``python -m benchmarks.pyspy
FILE.svg`` prints the largest of either (``--self``).
"""

from __future__ import annotations

import argparse
import html
import re
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import TracebackType

_TITLE = re.compile(r"<title>(?P<name>.*?) \((?P<samples>[\d,]+) samples?, (?P<pct>[\d.]+)%\)</title>")
# A box with its place: py-spy writes each box's depth as ``y`` and its span in samples as ``fg:x``/``fg:w``.
_BOX = re.compile(
    r"<title>(?P<name>.*?) \([\d,]+ samples?, [\d.]+%\)</title>"
    r"<rect [^>]*?y=\"(?P<y>[\d.]+)\"[^>]*?fg:x=\"(?P<x>\d+)\" fg:w=\"(?P<w>\d+)\""
)


def _is_python(pid: int) -> bool:
    try:
        exe = Path(f"/proc/{pid}/exe").resolve().name
    except OSError:
        return False
    return exe.startswith("python")


class Profiles:
    """py-spy on several processes for one stretch of load; ``<out_dir>/<label>-<role>.svg`` each."""

    def __init__(self, out_dir: Path, label: str, pids: dict[str, int], rate_hz: int = 100) -> None:
        if shutil.which("py-spy") is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy)")
        self.out_dir = out_dir
        self.label = label
        self.pids = {role: pid for role, pid in pids.items() if _is_python(pid)}
        self.rate_hz = rate_hz
        self.files: dict[str, Path] = {}
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Profiles:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for role, pid in sorted(self.pids.items()):
            path = self.out_dir / f"{self.label}-{role}.svg"
            # --nonblocking: never pause the target to read it (a paused worker would distort the very latency
            # the benchmark measures). Idle threads are left out (py-spy's default): waiting is not work.
            command = ["py-spy", "record", "--pid", str(pid), "--output", str(path), "--rate", str(self.rate_hz)]
            command += ["--nonblocking", "--format", "flamegraph"]
            self._procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            self.files[role] = path
        return self

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self._procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def frames(svg: Path) -> list[tuple[str, int]]:
    """Every frame box of a py-spy flame graph: (title, samples), in document order."""
    return [(html.unescape(m["name"]), int(m["samples"].replace(",", ""))) for m in _TITLE.finditer(svg.read_text())]


def top_frames(svg: Path, count: int = 25) -> list[tuple[str, int, float]]:
    """The ``count`` functions with the most samples under them: (function, samples, share of all samples).

    A function met at several places of the graph adds up; the root box ("all") gives the total.
    """
    boxes = frames(svg)
    if not boxes:
        return []
    total = max(samples for _, samples in boxes)
    by_name: dict[str, int] = defaultdict(int)
    for name, samples in boxes:
        if name != "all":
            by_name[name] += samples
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:count]
    return [(name, samples, samples / total) for name, samples in ranked]


def self_frames(svg: Path, count: int = 25) -> list[tuple[str, int, float]]:
    """The ``count`` functions with the most samples of their own (innermost frame): (function, samples, share).

    A box's own samples are its span less its children's, the boxes one row further from the root inside it.
    """
    boxes = [
        (html.unescape(m["name"]), float(m["y"]), int(m["x"]), int(m["w"])) for m in _BOX.finditer(svg.read_text())
    ]
    if not boxes:
        return []
    root = max(boxes, key=lambda box: box[3])
    total = root[3]
    rows = sorted({y for _, y, _, _ in boxes})
    if len(rows) < 2:
        return [(root[0], total, 1.0)]
    # py-spy draws the root at the bottom (icicle graphs put it at the top): children lie a row away from it.
    step = (rows[1] - rows[0]) if root[1] == rows[0] else (rows[0] - rows[1])
    by_row: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for _, y, x, w in boxes:
        by_row[y].append((x, w))
    own: dict[str, int] = defaultdict(int)
    for name, y, x, w in boxes:
        children = sum(cw for cx, cw in by_row.get(y + step, ()) if x <= cx and cx + cw <= x + w)
        own[name] += w - children
    ranked = sorted(own.items(), key=lambda kv: -kv[1])[:count]
    return [(name, samples, samples / total) for name, samples in ranked]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The largest frames of py-spy flame graphs.")
    parser.add_argument("svg", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--self", dest="own", action="store_true", help="rank by the samples a function was innermost")
    args = parser.parse_args(argv)
    rank = self_frames if args.own else top_frames
    for path in args.svg:
        print(f"\n{path}")
        for name, samples, share in rank(path, args.top):
            print(f"  {100 * share:5.1f}%  {samples:7d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
