"""The tests' ``free_port`` (tests/ports.py): ports handed out before any server binds them are all different (two
workers once got one metrics port between them, and one ran without metrics), below the ephemeral range, and from
each pytest-xdist worker's own slice."""

from __future__ import annotations

import pytest
from ports import ephemeral_low, free_port, free_port_run, port_range


def test_ports_handed_out_in_one_process_never_repeat() -> None:
    # 300 draws from the ~16,000 ports below the ephemeral range repeat one with odds of about 93% if drawn blindly.
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(port in port_range() and ephemeral_low() // 2 <= port < ephemeral_low() for port in ports)
    pair = free_port(with_successor=True)
    assert pair not in ports and pair + 1 not in ports and free_port() not in (pair, pair + 1)


def test_each_xdist_worker_draws_from_a_slice_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(port_range())
    assert slices[0].stop <= slices[1].start and len(slices[0]) == len(slices[1]) > 1000
    assert slices[0].start == ephemeral_low() // 2 and slices[1].stop <= ephemeral_low()


def test_a_run_of_ports_lies_below_the_ephemeral_range_and_is_never_handed_out_twice() -> None:
    """A multi-broker stack's ports: inside this worker's slice, so a broker's own outgoing connections cannot take
    one before it binds (the nemesis test's 3-broker Kafka once died at start that way)."""
    bases = [free_port_run(24) for _ in range(20)]
    runs = [set(range(base, base + 24)) for base in bases]
    assert all(run <= set(port_range()) for run in runs)
    assert sum(map(len, runs)) == len(set().union(*runs))
    assert free_port() not in set().union(*runs)
