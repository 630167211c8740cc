"""Soak: the whole pipeline under mixed load while workers die and a broker restarts; counts what was lost.

Starts a private 3-broker Kafka and a Redis (``cli.backbone.devstack``), the router, ingress, result service
and two CPU workers on a random-weight model, then for ``--minutes``:

* interactive, standard and batch requests (native ``POST /v1/requests``, greedy, ``ignore_eos``) from paced
  clients; an interactive request's TTFT is from the POST to its first token event in its Redis stream;
* every ``--kill-every`` seconds one worker gets ``SIGKILL`` and is restarted at once (alternating);
* halfway through, the broker leading the most request partitions gets ``SIGKILL`` and is started again
  ``--broker-down-s`` later.

At the end every accepted request's stream is audited: finished = seq 0..n contiguous with exactly one ``done``
last and ``max_tokens`` tokens; lost = no ``done`` within ``--drain-s`` after the load stops; duplicated = a
``seq`` or a ``done`` seen twice. Prints a JSON summary and the interactive p99 TTFT per minute, exit status 1
when anything was lost or duplicated. Not part of the test suite (it runs for minutes):

    PYTHONPATH=$PWD python3 -m benchmarks.soak --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from redis.asyncio import Redis

from benchmarks.common import REPO_ROOT, free_port, free_port_run, percentile, progress
from cli.backbone import devstack
from schemas import STREAM_FIELD, Names, parse_stream_event
from sluicegate.settings import Settings

API_KEY = "sk-soak-key"
MODEL = "tiny-soak"
TIERS = {"interactive": (16, 0.5), "standard": (48, 0.4), "batch": (96, 0.6)}  # max_tokens, seconds between
PROMPTS = ["The harbour at dawn", "Rivers run to the sea", "A lamp in the window", "Snow on the pass"]


@dataclass
class Accepted:
    tier: str
    max_tokens: int
    submitted_at: float
    ttft_s: float | None = None


@dataclass
class Soak:
    args: argparse.Namespace
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    services: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    accepted: dict[str, Accepted] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)
    events: list[tuple[float, str]] = field(default_factory=list)
    started_at: float = 0.0

    def start(self, name: str, *cli: str, **extra: str) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        self.services[name] = subprocess.Popen(
            [sys.executable, "-m", "cli.main", *cli],
            env={**self.env, **extra},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO_ROOT,
        )

    def start_worker(self, name: str) -> None:
        self.start(name, "worker", SLUICEGATE_WORKER_ID=name)

    def stop_all(self) -> None:
        for process in self.services.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.services.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

    def note(self, what: str) -> None:
        self.events.append((time.monotonic() - self.started_at, what))
        progress(f"soak t={time.monotonic() - self.started_at:.0f}s {what}")

    async def client(self, tier: str, stop: asyncio.Event, redis: Redis, names: Names, ingress: str) -> None:
        max_tokens, pause = TIERS[tier]
        rng = random.Random(tier)
        async with httpx.AsyncClient(
            base_url=ingress, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
        ) as http:
            while not stop.is_set():
                body = {
                    "model": MODEL,
                    "prompt": rng.choice(PROMPTS),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "priority": tier,
                }
                sent = time.monotonic()
                try:
                    response = await http.post("/v1/requests", json=body)
                except httpx.HTTPError as exc:
                    self.refused[f"{tier}:{type(exc).__name__}"] += 1
                    await asyncio.sleep(pause)
                    continue
                if response.status_code != 202:
                    self.refused[f"{tier}:{response.status_code}"] += 1
                    await asyncio.sleep(pause)
                    continue
                rid = response.json()["request_id"]
                self.accepted[rid] = Accepted(tier, max_tokens, sent - self.started_at)
                if tier == "interactive":
                    await self.first_token(redis, names, rid, sent)
                await asyncio.sleep(pause)

    async def first_token(self, redis: Redis, names: Names, rid: str, sent: float) -> None:
        key = names.stream_key(rid)
        deadline = sent + 60
        while time.monotonic() < deadline:
            try:
                answer = await redis.xread({key: "0-0"}, count=1, block=1000)
            except OSError:
                await asyncio.sleep(0.2)
                continue
            if answer:
                self.accepted[rid].ttft_s = time.monotonic() - sent
                return

    async def audit(self, redis: Redis, names: Names) -> dict[str, object]:
        finished = lost = duplicated = short = 0
        deadline = time.monotonic() + self.args.drain_s
        pending = set(self.accepted)
        while pending and time.monotonic() < deadline:
            for rid in list(pending):
                entries = await redis.xrange(names.stream_key(rid))
                if entries and parse_stream_event(entries[-1][1][STREAM_FIELD.encode()]).type in ("done", "error"):
                    pending.discard(rid)
            if pending:
                await asyncio.sleep(1.0)
        for rid, info in self.accepted.items():
            entries = await redis.xrange(names.stream_key(rid))
            events = [parse_stream_event(f[STREAM_FIELD.encode()]) for _, f in entries]
            seqs = [e.seq for e in events]
            dones = [e.type for e in events].count("done")
            duplicated += (len(seqs) - len(set(seqs))) + max(0, dones - 1)
            tokens = sum(len(getattr(e, "token_ids", [])) for e in events)
            if dones == 1 and seqs == list(range(len(events))) and events[-1].type == "done":
                finished += 1
                short += tokens != info.max_tokens
            else:
                lost += 1
        return {"finished": finished, "lost": lost, "duplicated": duplicated, "wrong_token_count": short}


def ttft_by_minute(accepted: dict[str, Accepted]) -> dict[int, dict[str, float]]:
    buckets: dict[int, list[float]] = defaultdict(list)
    for info in accepted.values():
        if info.tier == "interactive" and info.ttft_s is not None:
            buckets[int(info.submitted_at // 60)].append(info.ttft_s * 1000)
    return {
        minute: {
            "n": len(v),
            "p50_ms": round(percentile(v, 0.5), 1),
            "p99_ms": round(percentile(v, 0.99), 1),
            "max_ms": round(max(v), 1),
        }
        for minute, v in sorted(buckets.items())
    }


async def run(soak: Soak, settings: Settings, info: devstack.StackInfo, ingress: str) -> dict[str, object]:
    names = Names(soak.env["SLUICEGATE_TOPIC_PREFIX"])
    redis = Redis.from_url(info.redis_url)
    stop = asyncio.Event()
    soak.started_at = time.monotonic()
    clients = [asyncio.create_task(soak.client(t, stop, redis, names, ingress)) for t in TIERS]
    duration = soak.args.minutes * 60
    next_kill, kills, broker_done = soak.args.kill_every, 0, False
    while (elapsed := time.monotonic() - soak.started_at) < duration:
        if elapsed >= next_kill:
            victim = f"worker-{'ab'[kills % 2]}"
            os.kill(soak.services[victim].pid, signal.SIGKILL)
            soak.services[victim].wait(timeout=30)
            soak.start_worker(victim)
            kills += 1
            next_kill += soak.args.kill_every
            soak.note(f"SIGKILL {victim} (restarted)")
        if not broker_done and elapsed >= duration / 2:
            broker_done = True
            node = random.Random(1).randrange(len(info.kafka_pids))
            os.kill(info.kafka_pids[node], signal.SIGKILL)
            soak.note(f"SIGKILL broker node {node + 1}")
            await asyncio.sleep(soak.args.broker_down_s)
            await asyncio.to_thread(devstack.up, settings)
            soak.note(f"broker node {node + 1} back")
        await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*clients)
    soak.note("load stopped; auditing")
    audit = await soak.audit(redis, names)
    await redis.aclose()
    tiers = Counter(a.tier for a in soak.accepted.values())
    return {
        "minutes": soak.args.minutes,
        "accepted": len(soak.accepted),
        "accepted_by_tier": dict(tiers),
        **audit,
        "refused": dict(soak.refused),
        "worker_kills": kills,
        "broker_restarts": int(broker_done),
        "interactive_ttft_by_minute": ttft_by_minute(soak.accepted),
        "events": [(round(t, 1), what) for t, what in soak.events],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between worker SIGKILLs")
    parser.add_argument("--broker-down-s", type=float, default=10.0)
    parser.add_argument("--drain-s", type=float, default=120.0, help="how long unfinished streams may take at the end")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args()

    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="sluicegate-soak-"))
    model = make_tiny_model(workdir / MODEL, arch="llama", num_layers=2, hidden_size=64)
    base = free_port_run(7)
    settings = Settings(
        state_dir=REPO_ROOT / ".sluicegate", kafka_port=base, redis_port=base + 6, kafka_brokers=3, topic_partitions=4
    )
    info = devstack.up(settings)
    ingress_port, result_port = free_port(), free_port()
    soak = Soak(args, workdir)
    soak.env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": "1",
        "SLUICEGATE_KAFKA_BOOTSTRAP": info.kafka_bootstrap,
        "SLUICEGATE_REDIS_URL": info.redis_url,
        "SLUICEGATE_TOPIC_PREFIX": f"soak{random.randrange(1 << 32):08x}.",
        "SLUICEGATE_TOPIC_PARTITIONS": "4",
        "SLUICEGATE_API_KEYS": API_KEY,
        "SLUICEGATE_STREAM_TOKEN_SECRET": "soak-secret",
        "SLUICEGATE_MODEL": str(model),
        "SLUICEGATE_MODEL_NAME": MODEL,
        "SLUICEGATE_INGRESS_PORT": str(ingress_port),
        "SLUICEGATE_RESULT_PORT": str(result_port),
        "SLUICEGATE_HEARTBEAT_INTERVAL_S": "0.5",
        "SLUICEGATE_KV_CACHE_GB": "0.05",
        "SLUICEGATE_WORKER_METRICS_PORT": "0",
        "SLUICEGATE_ROUTER_METRICS_PORT": "0",
        "SLUICEGATE_LIMIT_RPS": "100000",
        # The model is declared served: a moment with no fresh heartbeat (both workers mid-restart) queues
        # requests in Kafka instead of answering 404.
        "SLUICEGATE_SERVED_MODELS": MODEL,
    }
    try:
        for worker in ("worker-a", "worker-b"):
            soak.start_worker(worker)
        soak.start("router", "router")
        soak.start("ingress", "ingress")
        soak.start("result-service", "result-service")
        ingress = f"http://127.0.0.1:{ingress_port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{ingress}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or soak.services["ingress"].poll() is not None:
                args.keep = True
                raise SystemExit(f"ingress not ready; logs in {workdir}")
            time.sleep(0.5)
        time.sleep(5)  # the workers join their group
        summary = asyncio.run(run(soak, settings, info, ingress))
    finally:
        soak.stop_all()
        devstack.down(settings)
        for i in range(3):
            shutil.rmtree(settings.state_dir / f"kafka-{base + 2 * i}", ignore_errors=True)
        shutil.rmtree(settings.state_dir / f"redis-{base + 6}", ignore_errors=True)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(summary, indent=1))
    return 1 if summary["lost"] or summary["duplicated"] else 0


if __name__ == "__main__":
    sys.exit(main())
