"""The e2e harness's ``free_port``: ports handed out before any service binds them are all different (two workers
once got one metrics port between them, and one ran without metrics). No services run."""

from __future__ import annotations

from .conftest import _ephemeral_low, free_port


def test_ports_handed_out_in_one_process_never_repeat() -> None:
    # 300 draws from the ~16,000 ports below the ephemeral range repeat one with odds of about 93% if drawn blindly.
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(_ephemeral_low() // 2 <= port < _ephemeral_low() for port in ports)
