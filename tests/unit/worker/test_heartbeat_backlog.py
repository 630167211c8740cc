"""The backlog seconds a worker samples ride in its heartbeat for admission: finite figures only (a backlog with no
measured generation rate yet is infinite, and admission must not refuse on it), counting the engine's own queue; and
the request timings the worker records (an embedding has no first token)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition

from gpu_workers.engine.outputs import RequestMetrics
from gpu_workers.worker.telemetry import RequestWatch, WorkerTelemetry
from schemas import InferenceRequest, Names, Usage


class _Consumer:
    """The group consumer as the sampler sees it: assigned partitions, their end offsets and positions."""

    def __init__(self, ends: dict[TopicPartition, int], positions: dict[TopicPartition, int]) -> None:
        self.ends, self.positions = ends, positions

    def assignment(self) -> set[TopicPartition]:
        return set(self.ends)

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.ends[tp] for tp in tps}

    async def position(self, tp: TopicPartition) -> int:
        return self.positions[tp]


async def test_only_finite_backlog_seconds_are_published() -> None:
    stats = SimpleNamespace(num_running=0, waiting_by_priority={})
    engine: Any = SimpleNamespace(stats=lambda: stats, add_delta_observer=lambda _: None)
    telemetry = WorkerTelemetry(engine, "m", "w")
    names = Names()
    telemetry.set_topics({names.request_topic("m", t): t for t in ("interactive", "standard", "batch")})
    assert telemetry.backlog_seconds is None  # nothing sampled yet: the heartbeat carries none
    standard = TopicPartition(names.request_topic("m", "standard"), 0)
    interactive = TopicPartition(names.request_topic("m", "interactive"), 0)
    consumer: Any = _Consumer({standard: 10, interactive: 4}, {standard: 7, interactive: 4})
    await telemetry._sample_once(consumer, engine)
    # Nothing waits at interactive (0 s); 3 standard requests and no measured rate: no figure at or below it.
    assert telemetry.backlog_seconds == {"interactive": 0.0}


async def test_requests_waiting_in_the_engine_count_in_the_backlog() -> None:
    # Nothing left in Kafka, but the worker took 20 standard requests at once and 16 of its seats are busy: the 16
    # the 4 free seats cannot take wait in the engine's queue, and admission must see them.
    stats = SimpleNamespace(num_running=16, waiting_by_priority={1: 20})
    engine: Any = SimpleNamespace(stats=lambda: stats, add_delta_observer=lambda _: None)
    telemetry = WorkerTelemetry(engine, "m", "w", max_num_seqs=20)
    names = Names()
    telemetry.set_topics({names.request_topic("m", t): t for t in ("interactive", "standard", "batch")})
    telemetry.generation_rate.sample = lambda *_: 100.0  # type: ignore[method-assign]  # 100 tokens/s measured
    telemetry.tokens_per_request.as_mapping = lambda: {"interactive": 50.0, "standard": 50.0, "batch": 50.0}  # type: ignore[method-assign]
    standard = TopicPartition(names.request_topic("m", "standard"), 0)
    consumer: Any = _Consumer({standard: 10}, {standard: 10})
    await telemetry._sample_once(consumer, engine)
    assert telemetry.backlog_seconds == {"interactive": 0.0, "standard": 8.0, "batch": 8.0}  # 16 x 50 / 100


def _not_started() -> None:
    raise RuntimeError("engine not started")  # the engine's gauges are left out of the scrape


def test_an_embedding_is_timed_without_a_first_token_and_named_embeddings() -> None:
    engine: Any = SimpleNamespace(stats=_not_started, add_delta_observer=lambda _: None)
    telemetry = WorkerTelemetry(engine, "m", "w")
    record = SimpleNamespace(topic="t", partition=0, offset=0, timestamp=0)
    timings = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.1,
        first_token_time=10.4,
        finish_time=10.4,
        num_prompt_tokens=5,
        num_cached_tokens=0,
        num_output_tokens=0,
        num_preemptions=0,
    )
    for task, operation in (("embed", "embeddings"), ("generate", "text_completion")):
        request = InferenceRequest(request_id=f"r-{task}", model="m", prompt="hi", task=task)
        watch = RequestWatch(telemetry, request, record)
        watch.engine_finished(timings)
        watch.finished("stop", Usage(prompt_tokens=5, completion_tokens=0 if task == "embed" else 1, total_tokens=5))
        count = telemetry.registry.get_sample_value
        labels = {"gen_ai_operation_name": operation, "gen_ai_request_model": "m"}
        assert count("gen_ai_server_request_duration_seconds_count", labels) == 1
        ttft = count("gen_ai_server_time_to_first_token_seconds_count", labels)
        assert ttft == (None if task == "embed" else 1), (task, ttft)
