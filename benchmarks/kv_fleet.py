"""The KV cache across a fleet of two workers, on the real model (SmolLM2-135M-Instruct, ``up``'s default) and a
multi-turn chat trace: today's routing (the prompt-prefix key), routing on the exact cached prefix (the workers'
KV events into the router's index), and the same with offload tiers (host memory and disk; the shared tier in the
kill phase). Reports the prefix-hit rate against an unbounded single cache on the same trace, TTFT p50/p99 (all
turns and turns after the first), tok/s and each worker's share of the requests. Then one worker dies mid-run:
its requests resume on the other, with and without the shared tier (a Redis of its own on a private port).

What it is: engine-level. Two engines in this process, each a worker, fed each round's turns as one batch (the
turns of a round arrive together), the router's real index (:mod:`router.kv_index`) fed by the engines' real
events (through the worker's own message conversion), and the router's cost (cached prefix against queued
requests). What it is not: Kafka, ingress and the overload rule are not in the path, and the two engines take
turns on the same cores (each round's makespan is the slower worker's time). On a CPU worker the host tier is the
same RAM as the pool: its gain is a pool that is larger than the engine's, reached through a copy.

    python -m benchmarks.kv_fleet --quick          # a few minutes
    python -m benchmarks.kv_fleet                  # 32 conversations x 6 turns, a ~1.5k-token system prompt
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.worker.kv_events import to_message
from gpu_workers.worker.kv_tiers import RedisBlockStore
from router.kv_index import KVIndex, short_hash
from router.kv_routing import CachedPrefixPolicy
from router.policy import keyed_partition
from sluicegate.block_hashes import prompt_block_hashes
from sluicegate.models.smollm2 import fetch_smollm2

BLOCK = 16
MODEL = "smollm2"
WORKERS = ("w0", "w1")


@dataclass
class Shape:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    output_tokens: int
    pool_blocks: int
    kill_after_turn: int


FULL = Shape(32, 6, 1536, 48, 24, 320, 3)
QUICK = Shape(8, 3, 384, 32, 12, 96, 1)


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    ttft_later: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    makespan_s: float = 0.0
    per_worker: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WORKERS, 0))
    tier_hits: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        def pct(xs: list[float], q: float) -> float:
            return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else 0.0

        total = sum(self.per_worker.values()) or 1
        return {
            "hit_rate": round(self.cached_tokens / max(self.prompt_tokens, 1), 3),
            "ttft_p50_ms": pct(self.ttft, 0.5),
            "ttft_p99_ms": pct(self.ttft, 0.99),
            "later_turns_ttft_p50_ms": pct(self.ttft_later, 0.5),
            "tok_s": round(self.output_tokens / self.makespan_s, 1) if self.makespan_s else 0.0,
            "max_worker_share": round(max(self.per_worker.values()) / total, 2),
            "tier_hit_blocks": self.tier_hits,
        }


def _trace(shape: Shape, seed: int = 0) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and, per conversation, each turn's new user tokens (token ids of ordinary text)."""
    rng = random.Random(seed)
    vocab = range(200, 20000)
    system = [rng.choice(vocab) for _ in range(shape.system_tokens)]
    users = [
        [[rng.choice(vocab) for _ in range(shape.user_tokens)] for _ in range(shape.turns)]
        for _ in range(shape.conversations)
    ]
    return system, users


class Fleet:
    """Two engines, the router's index of their events, and the routing mode."""

    def __init__(self, gguf: Path, shape: Shape, mode: str, tiers: dict[str, dict] | None) -> None:
        self.mode = mode
        self.engines = {w: self._engine(gguf, shape, (tiers or {}).get(w)) for w in WORKERS}
        self.index = KVIndex()
        self.policy = CachedPrefixPolicy()
        self._seq = dict.fromkeys(WORKERS, 0)
        for w in WORKERS:
            self._publish(w, self.engines[w].engine.kv_snapshot())

    @staticmethod
    def _engine(gguf: Path, shape: Shape, tiers: dict | None) -> LLM:
        blocks = shape.pool_blocks
        return LLM(str(gguf), block_size=BLOCK, num_kv_blocks=blocks, max_model_len=blocks * BLOCK,
                   enable_kv_events=True, kv_offload=tiers, max_num_batched_tokens=2048)  # fmt: skip

    def _publish(self, worker: str, events) -> None:
        messages = []
        if events.snapshot or events.stored or events.removed:
            messages.append(events)
        messages += events.tiers
        for e in messages:
            self.index.apply(to_message(e, model=MODEL, worker_id=worker, seq=self._seq[worker]))
            self._seq[worker] += 1

    def drain_events(self) -> None:
        for w, llm in self.engines.items():
            events = llm.engine.take_kv_events()
            if events is not None:
                self._publish(w, events)

    def route(self, prompt: list[int], assigned: dict[str, int], alive: tuple[str, ...]) -> str:
        if self.mode == "key" or len(alive) == 1:
            # Today's key: the prompt's first 64 tokens (all conversations share the system prompt: one key).
            key = json.dumps(prompt[:64]).encode()
            return alive[keyed_partition(key, list(range(len(alive))))] if self.mode == "key" else alive[0]
        hashes = [short_hash(h) for h in prompt_block_hashes(prompt, BLOCK, 0, self.policy.max_blocks)]
        costs = {}
        for w in alive:
            cached = self.index.weighted_blocks(MODEL, w, hashes, self.policy.tier_weights) * BLOCK
            costs[w] = (len(hashes) * BLOCK - cached) + assigned[w] * self.policy.tokens_per_request
        return min(alive, key=lambda w: (costs[w], w))


def _serve(fleet: Fleet, batches: dict[str, list[list[int]]], shape: Shape, result: Result, later: bool) -> dict:
    params = SamplingParams(max_tokens=shape.output_tokens, temperature=0.0, ignore_eos=True)
    outputs, slowest = {}, 0.0
    for w, prompts in batches.items():
        if not prompts:
            continue
        start = time.perf_counter()
        outs = fleet.engines[w].generate(prompts, params)
        slowest = max(slowest, time.perf_counter() - start)
        for prompt, out in zip(prompts, outs, strict=True):
            ttft = out.metrics.time_to_first_token or 0.0
            result.ttft.append(ttft)
            if later:
                result.ttft_later.append(ttft)
            result.prompt_tokens += len(prompt)
            result.cached_tokens += out.num_cached_tokens
            result.output_tokens += len(out.token_ids)
            outputs[tuple(prompt)] = out.token_ids
    result.makespan_s += slowest
    fleet.drain_events()
    return outputs


def run_mode(gguf: Path, shape: Shape, mode: str, tiers: dict[str, dict] | None) -> tuple[Result, float]:
    """The trace under one routing mode; also the unbounded single cache's hit rate on the same trace."""
    system, users = _trace(shape)
    fleet = Fleet(gguf, shape, "key" if mode == "key" else "events", tiers)
    history = [list(system) for _ in users]
    result = Result()
    seen: set[bytes] = set()
    unbounded_hits = 0
    for turn in range(shape.turns):
        batches: dict[str, list[list[int]]] = {w: [] for w in WORKERS}
        assigned = dict.fromkeys(WORKERS, 0)
        for c, user in enumerate(users):
            history[c] += user[turn]
            prompt = list(history[c])
            hashes = prompt_block_hashes(prompt, BLOCK)
            unbounded_hits += next((i for i, h in enumerate(hashes) if h not in seen), len(hashes)) * BLOCK
            seen.update(hashes)  # a cache shared by the round's batch: later prompts of the round find it
            w = fleet.route(prompt, assigned, WORKERS)
            assigned[w] += 1
            result.per_worker[w] += 1
            batches[w].append(prompt)
        outputs = _serve(fleet, batches, shape, result, later=turn > 0)
        for c in range(len(users)):
            history[c] += outputs[tuple(history[c])]
            seen.update(prompt_block_hashes(history[c], BLOCK))
    for llm in fleet.engines.values():
        stats = llm.engine.stats().kv_offload
        if stats is not None:
            for tier, n in stats.hits.items():
                result.tier_hits[tier] = result.tier_hits.get(tier, 0) + n
        llm.engine.close()
    return result, unbounded_hits / max(result.prompt_tokens, 1)


def kill_phase(gguf: Path, shape: Shape, tiers: dict[str, dict]) -> dict[str, object]:
    """Serve the trace up to ``kill_after_turn`` on two workers, then kill w1: its conversations' next turn resumes
    on w0 (their prompts as w1 last saw them). TTFT of those resumed turns, and of w0's own next turns."""
    system, users = _trace(shape, seed=1)
    fleet = Fleet(gguf, shape, "events", tiers)
    history = [list(system) for _ in users]
    owner: dict[int, str] = {}
    for turn in range(shape.kill_after_turn + 1):
        batches: dict[str, list[list[int]]] = {w: [] for w in WORKERS}
        assigned = dict.fromkeys(WORKERS, 0)
        for c, user in enumerate(users):
            history[c] += user[turn]
            w = fleet.route(history[c], assigned, WORKERS)
            assigned[w] += 1
            owner[c] = w
            batches[w].append(list(history[c]))
        outputs = _serve(fleet, batches, shape, Result(), later=False)
        for c in range(len(users)):
            history[c] += outputs[tuple(history[c])]
    fleet.engines["w1"].engine.offloader and fleet.engines["w1"].engine.offloader.flush()
    fleet.engines.pop("w1").engine.close()  # killed: its pool and host tier are gone
    survivor = Result()
    resumed = [list(history[c]) for c in owner if owner[c] == "w1"]
    own = [list(history[c]) for c in owner if owner[c] == "w0"]
    start = time.perf_counter()
    params = SamplingParams(max_tokens=shape.output_tokens, temperature=0.0, ignore_eos=True)
    outs = fleet.engines["w0"].generate(resumed, params) if resumed else []
    resume_s = time.perf_counter() - start
    _serve(fleet, {"w0": own}, shape, survivor, later=True)
    stats = fleet.engines["w0"].engine.stats().kv_offload
    fleet.engines["w0"].engine.close()
    ttfts = sorted((o.metrics.time_to_first_token or 0.0) for o in outs)
    return {
        "resumed_requests": len(resumed),
        "resume_s": round(resume_s, 2),
        "resumed_ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1000, 1) if ttfts else 0.0,
        "resumed_cached_share": round(sum(o.num_cached_tokens for o in outs) / max(sum(len(p) for p in resumed), 1), 3),
        "survivor_next_turn_ttft_p50_ms": survivor.summary()["ttft_p50_ms"],
        "shared_hit_blocks": stats.hits["shared"] if stats else 0,
    }


def _redis(port: int, folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(0.5)
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 conversations x 3 turns, a 384-token system prompt")
    parser.add_argument("--model-cache", default=None, help="folder of the cached SmolLM2 GGUF (fetched if absent)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--redis-port", type=int, default=45001, help="port of the shared tier's own Redis")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = QUICK if args.quick else FULL
    gguf = fetch_smollm2(args.model_cache)
    work = Path(tempfile.mkdtemp(prefix="kv_fleet_"))
    report: dict[str, object] = {"shape": shape.__dict__, "cpu_threads": torch.get_num_threads()}
    host = dict(host_bytes=256 << 20)
    try:
        for mode, tiers in (
            ("key", None),
            ("events", None),
            ("events+tiers", {w: host | dict(disk_dir=str(work / w), disk_bytes=1 << 30) for w in WORKERS}),
        ):
            result, unbounded = run_mode(gguf, shape, mode, tiers)
            report[mode] = result.summary() | {"unbounded_single_cache_hit_rate": round(unbounded, 3)}
            print(mode, json.dumps(report[mode]), flush=True)
        redis = _redis(args.redis_port, work)
        try:
            store = partial(RedisBlockStore, f"redis://127.0.0.1:{args.redis_port}/0")
            for name, shared in (("kill_without_shared", None), ("kill_with_shared", store)):
                tiers = {w: host | dict(shared_store=shared) for w in WORKERS} if shared else {w: host for w in WORKERS}
                report[name] = kill_phase(gguf, shape, tiers)
                print(name, json.dumps(report[name]), flush=True)
        finally:
            redis.terminate()
            redis.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
