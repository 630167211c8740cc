"""The worker intake's fair queue: deadlines first (earliest first), then tenants by tokens (virtual time), with
starts charged an estimate and settled to the tokens used; a tenant sending prompts 8x longer gets an equal token
share, not 8x, and another tenant's records behind its backlog start before that backlog drains."""

from __future__ import annotations

import heapq

import pytest

from gpu_workers.worker.fair_intake import FairIntake

SHORT, LONG = 40, 320  # tokens a start of tenant B and of tenant A costs: A's prompts are 8x longer


def _drain(queue: FairIntake[str], tier: str = "standard") -> list[str]:
    order = []
    while (held := queue.pop(tier)) is not None:
        order.append(held.item)
    return order


def test_a_short_tenant_behind_a_long_backlog_starts_before_the_backlog_drains() -> None:
    queue: FairIntake[str] = FairIntake()
    for i in range(20):
        queue.push("standard", f"A{i}", "a", LONG)
    for i in range(8):
        queue.push("standard", f"B{i}", "b", SHORT)
    order = _drain(queue)
    # A's first start costs 320 tokens, so B's eight (8 x 40 = 320) all go before A's second-but-next one.
    assert order[:10] == ["A0", "B0", "B1", "B2", "B3", "B4", "B5", "B6", "B7", "A1"]
    assert sorted(order) == sorted([f"A{i}" for i in range(20)] + [f"B{i}" for i in range(8)])


@pytest.mark.parametrize("first", ["a", "b"])
def test_tokens_started_are_shared_evenly_with_8x_longer_prompts(first: str) -> None:
    queue: FairIntake[str] = FairIntake()
    # Both tenants keep 50 records held (more arrive as they start): a backlogged pair, arrival order irrelevant.
    for tenant in (first, "b" if first == "a" else "a"):
        for i in range(50):
            queue.push("standard", f"{tenant}{i}", tenant, LONG if tenant == "a" else SHORT)
    tokens = {"a": 0, "b": 0}
    for n in range(400):
        held = queue.pop("standard")
        assert held is not None
        tokens[held.tenant] += held.cost
        queue.push("standard", f"{held.tenant}+{n}", held.tenant, held.cost)  # the tenant's next request
    share = tokens["b"] / tokens["a"]
    assert 0.9 <= share <= 1.1, tokens
    assert 8 * tokens["a"] / LONG == pytest.approx(tokens["b"] / SHORT, rel=0.1)  # B started ~8x as many


def test_shares_stay_even_when_records_run_on_a_few_seats_and_settle_to_what_they_used() -> None:
    """A worker with 4 seats: a record runs for as many ticks as tokens it uses, its start is charged prompt +
    max_tokens, and it settles to its real use (fewer output tokens than max_tokens). Both tenants' tokens served
    over the run stay within 10 % of each other though A's prompts are 8x longer."""
    queue: FairIntake[int] = FairIntake()
    prompt = {"a": 256, "b": 32}
    max_tokens, used_output = 64, 16
    for n in range(40):
        for tenant in ("a", "b"):
            queue.push("standard", n, tenant, prompt[tenant] + max_tokens)
    running: list[tuple[int, int, object]] = []  # (ends at tick, tie, held)
    served = {"a": 0, "b": 0}
    tick = 0
    serial = 0
    while tick < 20_000:
        while len(running) < 4:
            held = queue.pop("standard")
            assert held is not None
            used = prompt[held.tenant] + used_output
            serial += 1
            heapq.heappush(running, (tick + used, serial, held))
        tick, _, held = heapq.heappop(running)
        used = prompt[held.tenant] + used_output  # type: ignore[attr-defined]
        served[held.tenant] += used  # type: ignore[attr-defined]
        queue.settle(held, used)  # type: ignore[arg-type]
        queue.push("standard", serial, held.tenant, prompt[held.tenant] + max_tokens)  # type: ignore[attr-defined]
    assert 0.9 <= served["b"] / served["a"] <= 1.1, served


def test_deadlines_start_first_earliest_first_whoever_the_tenant() -> None:
    queue: FairIntake[str] = FairIntake()
    queue.push("standard", "b-plain", "b", SHORT)
    queue.push("standard", "a-late", "a", LONG, deadline=200.0)
    queue.push("standard", "a-plain", "a", LONG)
    queue.push("standard", "b-soon", "b", SHORT, deadline=100.0)
    assert _drain(queue) == ["b-soon", "a-late", "b-plain", "a-plain"]


def test_tiers_are_apart_and_counted() -> None:
    queue: FairIntake[str] = FairIntake()
    queue.push("batch", "x", "a", 1)
    queue.push("interactive", "y", "a", 1)
    assert (queue.held("batch"), queue.held("interactive"), queue.held("standard"), len(queue)) == (1, 1, 0, 2)
    assert _drain(queue, "interactive") == ["y"]
    assert queue.pop("standard") is None
    assert _drain(queue, "batch") == ["x"]


def test_a_joining_tenant_gets_no_credit_for_idle_time() -> None:
    queue: FairIntake[str] = FairIntake()
    tickets = []
    for i in range(10):
        queue.push("standard", f"A{i}", "a", LONG)
    queue.push("standard", "B-early", "b", SHORT)  # B is live, so A's starts are charged
    tickets = [queue.pop("standard") for _ in range(11)]
    for held in tickets:
        assert held is not None
        queue.settle(held)
    assert queue.vtime("a") is None and queue.vtime("b") is None  # nothing live: forgotten
    queue.push("standard", "A-next", "a", LONG)
    queue.push("standard", "A-next2", "a", LONG)
    queue.push("standard", "B-next", "b", SHORT)
    assert queue.vtime("a") == queue.vtime("b")  # B starts level with A, not ahead by what A had before
    assert _drain(queue) == ["A-next", "B-next", "A-next2"]


def test_settling_replaces_the_estimate_with_the_tokens_used() -> None:
    queue: FairIntake[str] = FairIntake()
    queue.push("standard", "a1", "a", 1000)  # max_tokens of 1000 estimated...
    queue.push("standard", "b1", "b", 100)
    queue.push("standard", "b2", "b", 100)
    a1 = queue.pop("standard")
    assert a1 is not None and a1.item == "a1"
    assert queue.vtime("a") == 1000
    queue.push("standard", "a2", "a", 1000)  # (pushed first: a tenant with nothing live is forgotten)
    queue.settle(a1, 50)  # ...but it stopped after 50 tokens in all
    assert queue.vtime("a") == 50
    assert _drain(queue) == ["b1", "a2", "b2"]  # b1 brings B to 100 > 50: A's turn again


def test_weights_scale_the_share() -> None:
    queue: FairIntake[str] = FairIntake({"gold": 2.0})
    for i in range(30):
        queue.push("standard", f"g{i}", "gold", 10)
        queue.push("standard", f"s{i}", "silver", 10)
    first = _drain(queue)[:30]
    assert sum(item.startswith("g") for item in first) == 20  # two to one


def test_dropped_records_are_returned_and_release_their_tenant() -> None:
    queue: FairIntake[str] = FairIntake()
    queue.push("standard", "p0-a", "a", 1)
    queue.push("standard", "p1-b", "b", 1, deadline=5.0)
    queue.push("batch", "p1-c", "c", 1)
    queue.push("standard", "p0-b", "b", 1)
    assert sorted(queue.drop(lambda item: item.startswith("p0"))) == ["p1-b", "p1-c"]
    assert queue.vtime("c") is None and queue.vtime("b") is not None
    assert (queue.held("standard"), queue.held("batch")) == (2, 0)
    assert _drain(queue) == ["p0-a", "p0-b"]
