"""Time to first token of a response-cache hit against a miss, paired in one run.

Starts a worker (the demo-sized random-weight model unless ``--model``) and ingress as ``sluicegate``
subprocesses on the given Kafka and Redis, with the response cache on. Then, interleaved, for each of
``--pairs`` distinct greedy prompts: the first request (a miss: published, served by the worker, stored in the
background), a wait until the reply is stored, then the same request again (a hit: replayed from Redis). Each
TTFT is from sending the request to the first SSE chunk with text, measured by this client over HTTP.

    python -m benchmarks.response_cache --kafka 127.0.0.1:29092 --redis redis://127.0.0.1:26379/0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import redis

from benchmarks.common import fmt, free_port, markdown_table, percentile, progress
from schemas import Names

API_KEY = "sk-response-cache-bench"
MODEL = "tiny-cache-bench"


def _ttft(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> tuple[float | None, str, bool]:
    """(TTFT seconds, the whole text, whether usage said cached) of one streamed chat completion; TTFT None when
    the reply had no text (a random-weight model may end at once)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    text, cached = [], False
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
            cached = cached or bool((chunk.get("usage") or {}).get("cached"))
    return (None if first is None else first - started), "".join(text), cached


def _wait(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=2).json()
            if any(m["id"] == MODEL for m in models.get("data", [])):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError("the worker never served the model")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kafka", default=os.environ.get("SLUICEGATE_TEST_KAFKA_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--redis", default=os.environ.get("SLUICEGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--model", help="model folder (default: a demo-sized random-weight model)")
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cache-bench-"))
    model = args.model
    if model is None:
        from gpu_workers.engine.models.random_checkpoint import make_tiny_model

        progress("building the demo-sized model ...")
        model = str(make_tiny_model(work / MODEL, num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4))
    prefix = f"cb{uuid.uuid4().hex[:6]}."
    port = free_port()
    env = {
        **os.environ,
        "SLUICEGATE_KAFKA_BOOTSTRAP": args.kafka,
        "SLUICEGATE_REDIS_URL": args.redis,
        "SLUICEGATE_TOPIC_PREFIX": prefix,
        "SLUICEGATE_TOPIC_PARTITIONS": "2",
        "SLUICEGATE_API_KEYS": API_KEY,
        "SLUICEGATE_STREAM_TOKEN_SECRET": uuid.uuid4().hex,
        "SLUICEGATE_MODEL": model,
        "SLUICEGATE_MODEL_NAME": MODEL,
        "SLUICEGATE_INGRESS_PORT": str(port),
        "SLUICEGATE_RESPONSE_CACHE_TTL_S": "600",
        "SLUICEGATE_KV_CACHE_GB": "0.1",
        "SLUICEGATE_WORKER_METRICS_PORT": "0",
        "SLUICEGATE_LOG_LEVEL": "WARNING",
    }
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "cli.main", name],
            env=env,
            stdout=(work / f"{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for name in ("worker", "ingress")
    ]
    url = f"http://127.0.0.1:{port}"
    store = redis.Redis.from_url(args.redis)
    pattern = Names(prefix).response_cache_key(MODEL, "") + "*"
    try:
        _wait(url)
        misses: list[float] = []
        hits: list[float] = []
        skipped = 0
        with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
            _ttft(client, url, "warm-up", args.max_tokens)
            for n in range(args.pairs):
                prompt = f"pair {n}: {uuid.uuid4().hex}"
                stored = len(list(store.scan_iter(match=pattern)))
                miss, text, cached = _ttft(client, url, prompt, args.max_tokens)
                assert not cached
                deadline = time.monotonic() + 30
                while len(list(store.scan_iter(match=pattern))) <= stored:
                    assert time.monotonic() < deadline, "the reply was never stored"
                    time.sleep(0.01)
                hit, again, cached = _ttft(client, url, prompt, args.max_tokens)
                assert cached and again == text, "the hit differs from the miss"
                if miss is None or hit is None:
                    skipped += 1  # no text to time: the model ended at once
                    continue
                misses.append(miss)
                hits.append(hit)
        rows = [
            [name, str(len(v)), fmt(percentile(v, 0.5) * 1000, 2), fmt(percentile(v, 0.9) * 1000, 2)]
            for name, v in (("miss (worker)", misses), ("hit (cache)", hits))
        ]
        print(markdown_table(["request", "n", "TTFT p50 ms", "TTFT p90 ms"], rows))
        ratio = percentile(misses, 0.5) / percentile(hits, 0.5)
        print(f"\nmiss/hit TTFT p50 ratio: {ratio:.1f}x; pairs without text skipped: {skipped}")
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        store.close()
        for child in children:
            child.terminate()
        for child in children:
            child.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
