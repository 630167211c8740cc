"""benchmarks.pyspy reads py-spy's flame graphs back: samples per function, summed over its boxes."""

from __future__ import annotations

from pathlib import Path

from benchmarks.pyspy import frames, top_frames

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
