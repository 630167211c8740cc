"""Rebalances with real worker processes: while a third worker joins the group, the streams whose partitions stay
with their worker keep flowing (a request is handed off only once its partition has gone to another member).

The group runs with the default session (6 s, heartbeats every 1.5 s), as a deployment does. Prints one
``FAULT-REPORT`` line (run with ``-s``) with the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import itertools
import json
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from schemas import Names

from .conftest import Pipeline
from .test_faults_pause import (  # noqa: F401  (tiny_model_dir: the paced model, a module fixture)
    PROMPTS,
    audit,
    tiny_model_dir,
    wait_owners,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1"}


class _Arrivals:
    """When each stream's entries were first seen (polled every 10 ms in a thread)."""

    def __init__(self, pipeline: Pipeline, request_ids: list[str]) -> None:
        self._pipeline = pipeline
        self._ids = request_ids
        self.seen: dict[str, list[float]] = {rid: [] for rid in request_ids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Arrivals:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        import redis

        client = redis.Redis.from_url(self._pipeline.redis_url)
        names = Names(self._pipeline.prefix)
        try:
            while not self._stop.is_set():
                pipe = client.pipeline(transaction=False)
                for rid in self._ids:
                    pipe.xlen(names.stream_key(rid))
                lengths = pipe.execute()
                now = time.monotonic()
                for rid, length in zip(self._ids, lengths, strict=True):
                    times = self.seen[rid]
                    times += [now] * (int(length) - len(times))
                time.sleep(0.01)
        finally:
            client.close()

    def longest(self, start: float, end: float, request_id: str) -> float:
        """The longest gap of one stream within [start, end]: its pause."""
        return max(self.gaps(start, end, [request_id]), default=0.0)

    def gaps(self, start: float, end: float, request_ids: list[str]) -> list[float]:
        """Gaps between consecutive arrivals within [start, end] (the last one before ``start`` included)."""
        out = []
        for rid in request_ids:
            times = self.seen[rid]
            for before, after in itertools.pairwise(times):
                if after >= start and before <= end:
                    out.append(after - before)
        return out


@pytest.fixture
def joining(pipeline: Pipeline) -> Iterator[list[str]]:
    """Names of workers the test starts, stopped afterwards."""
    started: list[str] = []
    yield started
    for name in started:
        pipeline.kill(pipeline.find(name), signal.SIGTERM)


def test_streams_of_kept_partitions_flow_while_another_member_joins(pipeline: Pipeline, joining: list[str]) -> None:
    max_tokens = 600
    joining.append("worker-j1")
    pipeline.start_worker("worker-j1")
    pipeline.wait_workers(2)
    submitted = [
        pipeline.submit(prompt=p, max_tokens=max_tokens, temperature=0, ignore_eos=True)["request_id"]
        for p in PROMPTS * 2
    ]
    owners = wait_owners(pipeline, submitted, by_record=True)
    with _Arrivals(pipeline, submitted) as arrivals:
        time.sleep(1.0)
        joined_at = time.monotonic()
        joining.append("worker-j2")
        newcomer = pipeline.start_worker("worker-j2")
        deadline = time.monotonic() + 180
        while not pipeline.heartbeats().get("worker-j2") or not pipeline.heartbeats()["worker-j2"].partitions:
            assert newcomer.alive(), newcomer.log()
            assert time.monotonic() < deadline, "the third worker never got partitions"
            time.sleep(0.1)
        assigned_at = time.monotonic()
        time.sleep(2.0)
        window_end = time.monotonic()
    for rid in submitted:
        audit(pipeline, rid, max_tokens)
    # Streams whose owner the join did not change (the same worker wrote the running and the final record):
    # their partitions stayed with their worker.
    kept = [rid for rid in submitted if pipeline.wait_record(rid, "finished").worker_id == owners[rid]]
    moved = [rid for rid in submitted if rid not in kept]
    kept_gaps = sorted(arrivals.gaps(joined_at, window_end, kept))
    moved_gaps = sorted(arrivals.gaps(joined_at, window_end, moved))

    def p99(values: list[float]) -> float | None:
        return round(values[min(len(values) - 1, int(0.99 * len(values)))], 3) if values else None

    print(
        "\nFAULT-REPORT "
        + json.dumps(
            {
                "test": "rebalance_join_pause",
                "requests": len(submitted),
                "kept_streams": len(kept),
                "moved_streams": len(moved),
                "join_to_assigned_s": round(assigned_at - joined_at, 2),
                "kept_gap_p99_s": p99(kept_gaps),
                "kept_pause_each_s": [round(arrivals.longest(joined_at, window_end, rid), 3) for rid in kept],
                "moved_gap_max_s": round(max(moved_gaps), 3) if moved_gaps else None,
                "lost": 0,
                "duplicated": 0,
            }
        )
    )
    assert kept, "every stream moved: nothing to measure"
    assert max(arrivals.longest(joined_at, window_end, rid) for rid in kept) < 1.0
