"""benchmarks.pyspy reads py-spy's flame graphs back: samples per function, summed over its boxes."""

from __future__ import annotations

from pathlib import Path

from benchmarks.pyspy import frames, self_frames, top_frames

SVG = """<svg><g><title>all (2,000 samples, 100%)</title><rect x="0%" y="0" width="100%"/></g>
<g><title>serve (app.py:3) (150 samples, 75.00%)</title><rect x="0%" y="16" width="75%"/></g>
<g><title>send (conn.py:9) (90 samples, 45.00%)</title><rect x="0%" y="32" width="45%"/></g>
<g><title>poll (loop.py:1) (50 samples, 25.00%)</title><rect x="75%" y="16" width="25%"/></g>
<g><title>send (conn.py:9) (1,010 samples, 5.05%)</title><rect x="75%" y="32" width="5%"/></g></svg>"""


def test_top_frames_sum_a_functions_boxes_over_the_root(tmp_path: Path) -> None:
    svg = tmp_path / "p.svg"
    svg.write_text(SVG)
    assert frames(svg)[0] == ("all", 2000) and frames(svg)[-1] == ("send (conn.py:9)", 1010)
    top = top_frames(svg, 2)
    assert [name for name, _, _ in top] == ["send (conn.py:9)", "serve (app.py:3)"]
    assert top[0][1] == 1100 and top[0][2] == 1100 / 2000


def test_an_empty_graph_has_no_frames(tmp_path: Path) -> None:
    svg = tmp_path / "empty.svg"
    svg.write_text("<svg></svg>")
    assert top_frames(svg) == []


def _box(name: str, y: int, x: int, w: int) -> str:
    title = f"<title>{name} ({w} samples, {w / 10:.2f}%)</title>"
    return f'<g>{title}<rect x="0%" y="{y}" width="1%" fg:x="{x}" fg:w="{w}"/></g>'


# As py-spy draws it: the root at the bottom row (largest y), callees one row (16) above their caller.
PLACED = (
    "<svg>"
    + "".join(
        [
            _box("all", 64, 0, 1000),
            _box("run (loop.py:1)", 48, 0, 1000),
            _box("serve (app.py:3)", 32, 0, 700),
            _box("send (conn.py:9)", 16, 0, 400),
            _box("parse (app.py:7)", 16, 400, 100),
            _box("&lt;listcomp&gt; (app.py:8)", 0, 400, 60),
            _box("send (conn.py:9)", 32, 700, 250),
        ]
    )
    + "</svg>"
)


def test_self_frames_count_the_samples_a_function_was_innermost(tmp_path: Path) -> None:
    svg = tmp_path / "placed.svg"
    svg.write_text(PLACED)
    own = {name: samples for name, samples, _ in self_frames(svg, 10)}
    # send: 400 under serve + 250 under run, both leaves; serve keeps 700 - 400 - 100; parse 100 - 60.
    assert own == {
        "send (conn.py:9)": 650,
        "serve (app.py:3)": 200,
        "<listcomp> (app.py:8)": 60,
        "run (loop.py:1)": 50,
        "parse (app.py:7)": 40,
        "all": 0,
    }
    assert self_frames(svg, 1) == [("send (conn.py:9)", 650, 0.65)]
    assert sum(own.values()) == 1000  # every sample is some function's own, once


def test_an_empty_graph_has_no_own_frames(tmp_path: Path) -> None:
    svg = tmp_path / "empty.svg"
    svg.write_text("<svg></svg>")
    assert self_frames(svg) == []
