"""Request-path benchmark: what the pipeline adds on top of the engine, and how fast the relay fans out.

The whole pipeline runs on the tiny random-weight model on CPU: Kafka and Redis (a private
``cli.backbone.devstack`` on non-default ports, or the addresses given), ingress and the result service as
``sluicegate`` subprocesses, one worker in a child process of this script. At each rate (10, 50 and 100
requests/s by default) open-loop Poisson arrivals each ``POST /v1/requests`` (short prompt, ``max_tokens``
8, greedy) and then read the stream over the WebSocket the response names.

Overhead of one request = (first token received on the WebSocket - POST sent) - the engine's own TTFT
for that request. The engine TTFT is taken worker-side: the worker child wraps the engine's delta delivery
and keeps each request's ``RequestMetrics`` (arrival and first-token times, ``time.time()``, a clock every
process on the host shares). The child also stamps when a request's Kafka record reaches the worker and
when the XADD of its first token is sent, which splits the overhead into four stages:

* ``ingress+kafka``: POST sent -> the worker holds the Kafka record (HTTP, validation, status record,
  publish with ``acks=all``, broker, consumer fetch);
* ``pickup``: record -> ``engine.generate`` (stream state, cancel marker and status record in Redis);
* ``emit``: the engine's first token -> its XADD sent (engine process or thread -> worker event loop, shown alone
  as "engine -> worker loop", -> flush task);
* ``relay``: XADD sent -> the client has the event (Redis, result service XREAD, WebSocket frame). The
  client opens the WebSocket after the POST answers, so its connect overlaps the earlier stages.

``--api openai`` sends each request as a streamed ``POST /v1/completions`` instead, the way the OpenAI SDK does:
ingress follows the Redis stream itself and writes server-sent events on the same connection, so the result
service idles and ``relay`` ends at ingress's SSE chunk.

Relay throughput reuses :func:`benchmarks.relay.run_scenario` (``max`` mode: producers append as fast as
Redis takes them) against this pipeline's result service, with 100 and 500 clients, 10 per stream.

The private broker runs with its full JIT (C2, as a production broker does; the dev stack caps it at C1 for a
fast start), and 30 s of 100 requests/s warm the whole path up before anything is measured.

This module runs the levels and prints the report; its parts: ``pipeline_stack.py`` (backbone, services, the
timed worker child), ``pipeline_load.py`` (arrivals, stream readers, meters, transport floor) and
``pipeline_report.py`` (analysis and tables).

``--transports plain,secure`` runs a plaintext stack and a secured one (SASL_SSL Kafka with SCRAM-SHA-512, TLS-only
Redis with per-service ACL users) side by side in alternating rounds at the same load, and reports each one's
overhead and the difference (``pipeline_transports.py``; target: TLS adds at most 1 ms to the p50 at 10/s).

Run: ``python -m benchmarks.pipeline`` (``--help`` lists the knobs). Targets on a 2-core machine: overhead
p50 <= 5 ms and p99 <= 20 ms at 50 requests/s; >= 50,000 tokens/s relayed to 500 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks import relay
from benchmarks.common import fmt, load_average, percentile, progress, use_uvloop
from benchmarks.otlp_sink import OtlpSink
from benchmarks.pipeline_load import (
    API_PATHS,
    TransportFloor,
    cpu_seconds,
    ingress_timers,
    measure_transport_floor,
    run_rate,
)
from benchmarks.pipeline_report import (
    Level,
    RelayRow,
    analyse,
    cpu_table,
    floor_table,
    latency_table,
    relay_table,
    stage_table,
    tracing_split_table,
)
from benchmarks.pipeline_stack import Stack, pin, start_stack
from benchmarks.pipeline_transports import main_paired, parse_transports
from benchmarks.pyspy import Profiles
from sluicegate.settings import Settings

# Not the defaults (9092/6379) nor the test session's (19092/16379).
DEFAULT_KAFKA_PORT = 29692
DEFAULT_REDIS_PORT = 26692
DEFAULT_SECURE_KAFKA_PORT = 29892
DEFAULT_SECURE_REDIS_PORT = 26892


def run_relay(stack: Stack, args: argparse.Namespace) -> list[RelayRow]:
    """``benchmarks.relay``'s max-mode scenario against the pipeline's own result service."""
    rows = []
    pid = stack.services["result-service"].pid
    for clients in (int(c) for c in args.relay_clients.split(",") if c.strip()):
        streams = max(1, clients // args.clients_per_stream)
        scenario = relay.Scenario("max", clients, streams, args.relay_tokens, args.relay_batch, 0.0)
        progress(f"relay: {clients} clients on {streams} streams, {args.relay_tokens} tokens each ...")
        settings = stack.settings
        outcome = asyncio.run(
            relay.run_scenario(
                scenario, settings.redis_url, stack.result_url, pid, settings.topic_prefix, args.client_procs
            )
        )
        for error in outcome.errors[:5]:
            progress(f"  relay error: {error}")
        rows.append(RelayRow(outcome))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kafka-bootstrap", help="use this Kafka (with --redis-url) instead of a private dev stack")
    parser.add_argument("--redis-url", help="use this Redis (with --kafka-bootstrap)")
    parser.add_argument("--kafka-port", type=int, default=DEFAULT_KAFKA_PORT, help="private stack's Kafka port")
    parser.add_argument("--redis-port", type=int, default=DEFAULT_REDIS_PORT, help="private stack's Redis port")
    parser.add_argument("--rates", default="10,50,100", help="comma-separated arrival rates (requests/s)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    parser.add_argument("--max-tokens", type=int, default=8)
    # A production broker runs C2-compiled code; C2 needs thousands of requests through the path before it has
    # compiled it (with 20 s at 10 req/s its compiler was still busy while 50 req/s was measured).
    parser.add_argument(
        "--broker-jit",
        choices=("full", "c1"),
        default="full",
        help="JIT of the private broker: full (C2, as in production) or c1 (the dev stack's fast start)",
    )
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of warm-up load before measuring")
    parser.add_argument("--warmup-rate", type=float, default=100.0, help="requests/s of the warm-up load")
    parser.add_argument("--partitions", type=int, default=Settings().topic_partitions, help="partitions per topic")
    parser.add_argument("--relay-clients", default="100,500", help="comma-separated relay client counts; empty: none")
    parser.add_argument("--clients-per-stream", type=int, default=10)
    parser.add_argument("--relay-tokens", type=int, default=2000, help="token events per relayed stream")
    parser.add_argument("--relay-batch", type=int, default=20, help="events per stream per producer pipeline")
    parser.add_argument("--client-procs", type=int, default=2, help="processes the relay clients are spread over")
    parser.add_argument("--log-level", default="WARNING", help="log level of the services")
    parser.add_argument(
        "--floor-messages", type=int, default=300, help="messages per transport for the floor (0: skip it)"
    )
    parser.add_argument(
        "--engine",
        choices=("process", "thread"),
        default="process",
        help="the worker's engine: child process or thread",
    )
    parser.add_argument(
        "--tracing",
        choices=("off", "on", "mixed"),
        default="off",
        help="on: every service exports its spans over OTLP/HTTP to a local receiver (a process of its own); "
        "compare with an 'off' run made right before or after (docs/benchmarks.md pairs them). mixed: tracing on "
        "in every service, but only every other request is traced (its traceparent's sampled flag; the services "
        "root no trace of their own), and the report compares the two halves of the same run",
    )
    parser.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=1.0,
        help="with --tracing on: the fraction of request traces kept (OTEL_TRACES_SAMPLER=parentbased_traceidratio "
        "in every service); 1 keeps every trace",
    )
    parser.add_argument(
        "--metrics",
        choices=("on", "off"),
        default="on",
        help="off: SLUICEGATE_METRICS_ENABLED=false in every service (what the always-on metrics cost, paired "
        "with an 'on' run)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="record a py-spy flame graph of every Python process of the pipeline at each rate into this folder "
        "(<rate>rps-<process>.svg); the samplers take CPU of their own, so a profiled run shows where time goes, "
        "and its latency figures do not compare with an unprofiled run's",
    )
    parser.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="tiny: the random-weight 2-layer model every earlier figure used; smollm2: the default real model "
        "(SmolLM2-135M-Instruct, as `sluicegate up` serves it: fetched once, bf16 + cpu-int4 where the CPU has "
        "bf16); it decodes far slower on a CPU, so give it lower --rates",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the worker and its engine to the last CPU and everything else (backbone, services, clients) to "
        "the others (taskset-style, every thread), once the stack is up",
    )
    parser.add_argument(
        "--api",
        choices=list(API_PATHS),
        default="native",
        help="native: POST /v1/requests, then follow the stream over the result service's WebSocket; mux: the same, "
        "every stream on one multiplexed WebSocket (/v1/streams) that the load generator keeps open; openai: a "
        "streamed POST /v1/completions, whose events ingress relays itself (the OpenAI SDK's path: no result "
        "service, no second connection)",
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="ask every request for logprobs with this many alternatives (0: the sampled token's alone); with --api "
        "openai it makes every token a chunk, so the first token is stamped when it arrives even if its text is "
        "held back (part of a character), as the native stream's events are",
    )
    parser.add_argument(
        "--transports",
        default="plain",
        help="plain, secure (SASL_SSL + SCRAM Kafka, TLS + ACL Redis) or plain,secure: both stacks at once, "
        "measured in alternating rounds at the same load (no relay, floor or CPU tables then)",
    )
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per rate of a paired run")
    parser.add_argument("--secure-kafka-port", type=int, default=DEFAULT_SECURE_KAFKA_PORT)
    parser.add_argument("--secure-redis-port", type=int, default=DEFAULT_SECURE_REDIS_PORT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (service logs, model)")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if any(r <= 0 for r in rates) or args.duration <= 0 or args.max_tokens < 1:
        parser.error("rates and --duration must be positive and --max-tokens at least 1")
    if not 0.0 <= args.trace_sample_ratio <= 1.0:
        parser.error("--trace-sample-ratio must be between 0 and 1")
    try:
        transports = parse_transports(args.transports)
    except ValueError as exc:
        parser.error(str(exc))
    if len(transports) > 1:
        if args.rounds < 1 or args.kafka_bootstrap or args.pin or args.tracing != "off" or args.api == "mux":
            parser.error("a paired run takes --rounds >= 1 and its own stacks: no --kafka-bootstrap, --pin, "
                         "--tracing or --api mux")  # fmt: skip
        return main_paired(args, rates, transports)

    use_uvloop()
    workdir = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    sink = OtlpSink() if args.tracing in ("on", "mixed") else None
    args.otlp_endpoint = sink.url if sink is not None else ""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        del os.environ[name]  # only --tracing and --trace-sample-ratio decide
    if sink is not None and (args.trace_sample_ratio < 1.0 or args.tracing == "mixed"):
        os.environ["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
        os.environ["OTEL_TRACES_SAMPLER_ARG"] = "0" if args.tracing == "mixed" else repr(args.trace_sample_ratio)
    try:
        stack = start_stack(args, workdir, transport=transports[0])
    except BaseException:
        if sink is not None:
            sink.close()
        raise
    levels: list[Level] = []
    split: list[tuple[Level, Level]] = []  # --tracing mixed: each level's traced and untraced halves
    relay_rows: list[RelayRow] = []
    floor: TransportFloor | None = None
    load_before = load_average()
    pinned = pin(stack) if args.pin else None
    try:
        if args.warmup > 0:
            progress(f"warm-up: {args.warmup:g} s at {args.warmup_rate:g} req/s ...")
            asyncio.run(
                run_rate(
                    stack,
                    args.warmup_rate,
                    args.warmup,
                    max_tokens=args.max_tokens,
                    seed=args.seed,
                    label="warm ",
                    api=args.api,
                    logprobs=args.logprobs,
                )
            )
        for rate in rates:
            progress(f"{rate:g} req/s for {args.duration:g} s ...")
            before, cpu_before = asyncio.run(ingress_timers(stack, args.api)), cpu_seconds(stack.pids())
            with Profiles(args.profile, f"{rate:g}rps", stack.pids()) if args.profile else contextlib.nullcontext():
                samples = asyncio.run(
                    run_rate(
                        stack,
                        rate,
                        args.duration,
                        max_tokens=args.max_tokens,
                        seed=args.seed,
                        mixed_tracing=args.tracing == "mixed",
                        api=args.api,
                        logprobs=args.logprobs,
                    )
                )
            after, cpu_after = asyncio.run(ingress_timers(stack, args.api)), cpu_seconds(stack.pids())
            stack.check_alive()
            level = Level(rate, args.duration, samples)
            level.cpu_ms = {
                name: 1000 * (cpu_after[name] - cpu_before[name]) / max(1, len(samples))
                for name in cpu_after
                if name in cpu_before
            }
            level.publish_mean_ms, level.handler_mean_ms = (
                1000 * (after[k][0] - before[k][0]) / max(1, after[k][1] - before[k][1]) for k in ("publish", "handler")
            )
            levels.append(level)
            done = [s for s in samples if s.first and s.error is None]
            e2e = [1000 * (s.first - s.sent) for s in done]
            progress(f"  {len(done)}/{len(samples)} streamed; e2e TTFT p50 {fmt(percentile(e2e, 0.5))} ms")
        recorded = stack.stop_worker()
        for level in levels:
            analyse(level, recorded["stamps"])
            if args.tracing == "mixed":
                traced, untraced = (
                    Level(level.rate, level.duration_s, [x for x in level.samples if x.traced is t])
                    for t in (True, False)
                )
                analyse(traced, recorded["stamps"])
                analyse(untraced, recorded["stamps"])
                split.append((traced, untraced))
        if rates and not recorded["probes"]:
            progress("the worker wrote no stamps (see its log): no stage split")
        if args.floor_messages > 0:
            progress(f"transport floor: {args.floor_messages} Kafka records and stream entries at 50/s ...")
            floor = asyncio.run(measure_transport_floor(stack.settings, messages=args.floor_messages, rate=50))
        if args.relay_clients.strip():
            relay_rows = run_relay(stack, args)
    finally:
        stack.close()
        if sink is not None:
            progress(f"tracing {args.tracing}: the receiver took {sink.spans} spans")
            for name, count in sorted(sink.by_name().items(), key=lambda kv: -kv[1]):
                progress(f"  {count:7d}  {name}")
            sink.close()
        if args.keep:
            progress(f"logs and model kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"\npipeline benchmark on {os.cpu_count()} CPUs (Kafka, Redis, services, worker and clients share them); "
        f"load average before: {load_before}"
    )
    if pinned is not None:
        print("pinned: " + ", ".join(f"{role} CPU {sorted(cpus)}" for role, cpus in sorted(pinned.items())))
    served = stack.settings
    model = "tiny random Llama (2 layers, hidden 64)"
    if args.model == "smollm2":
        model = f"SmolLM2-135M-Instruct ({', '.join(filter(None, [served.dtype, served.quantization]))})"
    print(
        f"model: {model} on CPU, 1 torch thread; stream interval {served.stream_interval_ms:g} ms; "
        f"prompts ~8 tokens, "
        f"max_tokens {args.max_tokens}, greedy{'' if args.logprobs is None else f', logprobs {args.logprobs}'}; "
        f"Poisson arrivals, {args.duration:g} s per rate; "
        f"{args.partitions} partitions per topic; service log level {args.log_level}; tracing {args.tracing}"
        f"{f' (ratio {args.trace_sample_ratio:g})' if args.tracing == 'on' else ''}; "
        f"metrics {args.metrics}"
    )
    if levels:
        print(
            f"requests: {API_PATHS[args.api]}\n"
            "overhead = (first token at the client - POST sent) - engine TTFT, where the engine TTFT "
            "(first_token_time - arrival_time of the request's RequestMetrics) is recorded worker-side, "
            "per request, by the worker under test\n"
        )
        print(latency_table(levels))
        if split:
            print("\nthe same run split by the request's traceparent (traced: sampled and exported; untraced: not):\n")
            print(tracing_split_table(split))
        print("\nwhere the overhead goes (stages add up to it; see the module docstring):\n")
        print(stage_table(levels))
        print("\nCPU milliseconds per request, by process (clients: this script's load generator):\n")
        print(cpu_table(levels))
        for level in levels:
            if level.errors or level.unmatched:
                print(f"\n{level.rate:g} req/s: {len(level.errors)} failed, {level.unmatched} without worker timing")
                for error in sorted(set(level.errors))[:5]:
                    print(f"  {error}")
    if floor is not None:
        print("\nthe transports alone, same Kafka and Redis, after the rates (the floor any broker pipeline pays):\n")
        print(floor_table(floor, levels))
    if relay_rows:
        print("\nrelay throughput (benchmarks.relay, max mode, against this pipeline's result service):\n")
        print(relay_table(relay_rows))
    failed = any(level.errors for level in levels) or any(row.outcome.errors for row in relay_rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
