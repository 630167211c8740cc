"""``sluicegate bench`` against the running stack (tiny model), as a user runs it: the OpenAI path at a fixed
concurrency and at a Poisson rate, its JSON consistent with itself, goodput 0 under an impossible SLO; the native
path (``POST /v1/requests``, every stream on one multiplexed WebSocket); the Kafka-native path (``llm.inbound`` in,
Redis stream out); a Batch API job; and one-line errors for bad input."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import Pipeline, Service

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def bench(pipeline: Pipeline, *args: str, timeout_s: float = 200) -> subprocess.CompletedProcess[str]:
    """Run ``sluicegate bench ARGS`` with the key from ``OPENAI_API_KEY``; no progress bar (not a terminal)."""
    env = {k: v for k, v in pipeline.env.items() if k not in ("SLUICEGATE_API_KEY", "OPENAI_API_KEY")}
    env["OPENAI_API_KEY"] = pipeline.api_key
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "bench", "--base-url", f"{pipeline.ingress_url}/v1", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def report(pipeline: Pipeline, tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    result = bench(pipeline, *args, "--json", str(out))
    assert result.returncode == 0, result.stderr + result.stdout
    assert "sluicegate bench" in result.stdout, result.stdout  # the table's title
    assert "HTTP/1.1" not in result.stderr, result.stderr  # no log line per call
    return strict_json(out)


def strict_json(path: Path) -> dict[str, Any]:
    """The report as any JSON parser reads it: ``Infinity`` or ``NaN`` (Python's extensions) are refused."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def assert_consistent(run: dict[str, Any], requests: int, *, streamed: bool = True) -> None:
    """Every request completed, throughputs positive, each distribution's percentiles in order."""
    assert run["requests"] == run["completed"] == requests and run["failed"] == 0, run
    assert run["output_tokens"] > 0 and run["output_throughput"] > 0 and run["request_throughput"] > 0
    assert run["input_tokens"] > 0
    names = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms") if streamed else ("e2e_ms",)
    for name in names:
        dist = run[name]
        assert 0 <= dist["p50"] <= dist["p90"] <= dist["p95"] <= dist["p99"], (name, dist)
    if streamed:
        assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]


def test_openai_concurrency_sweep_json(pipeline: Pipeline, tmp_path: Path) -> None:
    got = report(
        pipeline, tmp_path, "--concurrency", "1,2", "--num-prompts", "6", "--output-len", "8", "--ignore-eos",
        "--slo-ttft-ms", "60000", "--slo-e2e-ms", "60000",
    )  # fmt: skip
    assert got["model"] == pipeline.model  # taken from GET /models
    assert [r["concurrency"] for r in got["runs"]] == [1, 2]
    for run in got["runs"]:
        assert_consistent(run, 6)
        assert run["output_tokens"] == 6 * 8  # ignore_eos: exactly max_tokens each, counted from usage
        assert run["good_requests"] == 6 and run["goodput"] == pytest.approx(run["request_throughput"])


def test_openai_rate_and_impossible_slo(pipeline: Pipeline, tmp_path: Path) -> None:
    got = report(
        pipeline, tmp_path, "--rate", "20,inf", "--num-prompts", "6", "--input-len", "16", "--output-len", "6",
        "--slo-ttft-ms", "0.001",
    )  # fmt: skip
    assert [run["rate"] for run in got["runs"]] == [20, "inf"]  # as vLLM's bench writes an infinite rate
    for run in got["runs"]:
        assert run["concurrency"] is None
        assert_consistent(run, 6)
        assert run["good_requests"] == 0 and run["goodput"] == 0
    assert got["slo"]["ttft_ms"] == 0.001 and got["dataset"] == "synthetic 16 words"


def test_openai_without_streaming(pipeline: Pipeline, tmp_path: Path) -> None:
    got = report(
        pipeline, tmp_path, "--no-stream", "--endpoint", "completions", "--num-prompts", "3", "--output-len", "4"
    )
    (run,) = got["runs"]
    assert_consistent(run, 3, streamed=False)
    assert run["ttft_ms"]["p50"] is None  # not seen without a stream


def test_kafka_native_path(pipeline: Pipeline, tmp_path: Path) -> None:
    got = report(
        pipeline, tmp_path, "--target", "kafka", "--model", pipeline.model, "--concurrency", "2", "--num-prompts", "4",
        "--output-len", "6", "--ignore-eos", "--kafka-bootstrap", pipeline.kafka_bootstrap,
        "--redis-url", pipeline.redis_url, "--topic-prefix", pipeline.prefix,
    )  # fmt: skip
    (run,) = got["runs"]
    assert_consistent(run, 4)
    assert run["output_tokens"] == 4 * 6


def test_native_path_on_one_multiplexed_socket(pipeline: Pipeline, tmp_path: Path) -> None:
    got = report(
        pipeline, tmp_path, "--target", "native", "--concurrency", "1,3", "--num-prompts", "6", "--output-len", "6",
        "--ignore-eos", "--endpoint", "completions",
    )  # fmt: skip
    assert got["model"] == pipeline.model and got["target"] == "native"
    for run in got["runs"]:
        assert_consistent(run, 6)
        assert run["output_tokens"] == 6 * 6  # from each done event's usage
        assert run["itl_ms"]["p50"] > 0  # several token events per request, each stamped as it arrived


def test_batch_path(pipeline: Pipeline, batch_worker: Service, tmp_path: Path) -> None:
    got = report(
        pipeline, tmp_path, "--target", "batch", "--num-prompts", "12", "--output-len", "4", "--poll-interval", "0.3"
    )
    batch = got["batch"]
    assert batch["status"] == "completed" and batch["lines"] == batch["completed"] == 12, batch
    assert batch["lines_per_s"] > 0 and batch["wall_s"] > 0


def test_bad_input_is_one_line(pipeline: Pipeline, tmp_path: Path) -> None:
    cases = [
        (("--model", "no-such-model", "--num-prompts", "1"), 2, "unknown model 'no-such-model'"),
        (
            (
                "--concurrency",
                "0",
            ),
            2,
            "--concurrency levels must be positive",
        ),
        (("--dataset", str(tmp_path / "missing.jsonl")), 2, "missing.jsonl"),
        (
            ("--target", "kafka", "--model", "no-such-model", "--redis-url", pipeline.redis_url),
            2,
            "no worker heartbeats",
        ),
    ]
    cases += [
        (("--concurrency", ""), 2, "--concurrency takes a comma-separated list"),
        (("--timeout", "0"), 2, "--timeout must be a positive number"),
        (("--slo-e2e-ms", "nan"), 2, "--slo-e2e-ms must be a positive number"),
        (("--slo-ttft-ms", "500ms"), 2, "invalid float value: '500ms'"),
        (("--json", str(tmp_path)), 2, "is a directory"),
        (("--base-url", pipeline.ingress_url, "--num-prompts", "1"), 2, f"the API is at {pipeline.ingress_url}/v1"),
    ]
    for args, code, text in cases:
        result = bench(pipeline, *args)
        assert result.returncode == code, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sluicegate bench: error: ") and text in lines[0], result.stderr
    gone = subprocess.run(
        [sys.executable, "-m", "cli.main", "bench", "--base-url", "http://127.0.0.1:9/v1"],
        capture_output=True, text=True, timeout=60, env=pipeline.env,
    )  # fmt: skip
    assert gone.returncode == 3 and "cannot reach http://127.0.0.1:9/v1/" in gone.stderr, gone.stderr
    no_broker = bench(
        pipeline, "--target", "kafka", "--model", pipeline.model, "--redis-url", pipeline.redis_url,
        "--topic-prefix", pipeline.prefix, "--kafka-bootstrap", "127.0.0.1:9", "--num-prompts", "1",
    )  # fmt: skip
    (line,) = no_broker.stderr.strip().splitlines()  # no aiokafka log lines, no unclosed-producer warning
    assert no_broker.returncode == 3 and line.startswith("sluicegate bench: error: cannot reach Kafka at 127.0.0.1:9")
    assert line.count("KafkaConnectionError") == 1, line


def test_a_failed_level_keeps_what_was_measured(pipeline: Pipeline, tmp_path: Path) -> None:
    """--timeout bounds each whole request (not each read); a level where every request failed ends the sweep with
    its error, and the table and JSON still say what was measured, marked incomplete."""
    out = tmp_path / "failed.json"
    result = bench(
        pipeline, "--concurrency", "1,2", "--num-prompts", "2", "--output-len", "400", "--ignore-eos",
        "--timeout", "0.02", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "all 2 requests failed, e.g. no answer within 0.02 s (--timeout)" in result.stderr
    assert "concurrency 1" in result.stdout  # the table of what ran
    got = strict_json(out)
    (run,) = got["runs"]
    assert run["failed"] == 2 and got["incomplete"].startswith("concurrency 1: all 2 requests failed")


def test_ctrl_c_keeps_the_levels_already_measured(pipeline: Pipeline, tmp_path: Path) -> None:
    """SIGINT during the second level: exit 130, the first level in the table and in the JSON, marked interrupted."""
    out = tmp_path / "interrupted.json"
    env = {k: v for k, v in pipeline.env.items() if k not in ("SLUICEGATE_API_KEY", "OPENAI_API_KEY")}
    env["OPENAI_API_KEY"] = pipeline.api_key
    command = [
        sys.executable, "-m", "cli.main", "bench", "--base-url", f"{pipeline.ingress_url}/v1",
        # The second level runs the 16 requests one at a time, 16 times longer than the first: seconds, even on a
        # busy box where this test's reads of stderr may wait their turn.
        "--concurrency", "16,1", "--num-prompts", "16", "--output-len", "1024", "--ignore-eos", "--json", str(out),
    ]  # fmt: skip
    # A process started in the background by a non-interactive shell (as `setsid nohup bash .ci/run &` starts CI)
    # inherits SIGINT ignored, and Python then leaves it ignored: the child gets a terminal's default back.
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as bench_run:
        assert bench_run.stderr is not None
        # Each level's progress line ends with a newline when the level ends (before it, a terminal gets redraws).
        seen: list[str] = []
        for line in bench_run.stderr:
            seen.append(line)
            if "concurrency 16" in line and "16/16" in line:
                break
        else:
            pytest.fail(f"the first level's end never showed on stderr: {seen!r}")
        bench_run.send_signal(signal.SIGINT)
        stdout, _ = bench_run.communicate(timeout=60)
    assert bench_run.returncode == 130
    assert "concurrency 16" in stdout and "concurrency 1 " not in stdout
    got = strict_json(out)
    assert got["incomplete"] == "interrupted" and [run["concurrency"] for run in got["runs"]] == [16]
    assert_consistent(got["runs"][0], 16)
