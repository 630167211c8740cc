"""The engine against llama.cpp on the CPU, on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): the same
8 chat prompts (chat template applied, the same token ids sent to every system), 64 greedy tokens each, the same
number of threads everywhere.

- Concurrency 1 (the prompts one after another): the engine (``gpu_workers.engine.LLM``, the GGUF dequantized to
  ``--dtype``, or kept quantized through ``--quantization``) against llama-cpp-python (pinned, in the benchmark's
  own environment, run in a subprocess) and transformers ``generate`` (a third reference, on the same dequantized
  folder the engine loads).
- 8 concurrent requests: the engine with all 8 submitted at once against ``llama-server`` (built from the
  llama.cpp source llama-cpp-python's sdist vendors) with 8 parallel slots, driven by 8 concurrent ``/completion``
  requests.

tok/s is generated tokens over wall time, prompt evaluation included (all systems keep their prompt caches on, as
they serve). Each round runs every system once, interleaved, so a busy machine slows all of them alike; the best
round of each system gives the ratios. The box is shared: before each measurement the run waits (``--quiet-wait``
seconds at most) for a second in which other processes keep less than a third of a core busy, and records what it
saw then and how many cores other processes kept busy while the measurement ran. Whether greedy outputs equal
llama.cpp's is reported for information (the engine runs dequantized weights, llama.cpp the Q4_1 ones).

    python -m benchmarks.vs_llamacpp --setup [--isa avx2]  # once: the peers' environment (.bench-env/llamacpp)
    python -m benchmarks.vs_llamacpp [--dtype float32,bfloat16] [--quantization Q] [--tokens 64] [--threads 2]
        [--rounds 3] [--quiet-wait 60] [--skip-peers] [--hf-dtype float32 | --skip-hf] [--out vs_llamacpp.json]
    python -m benchmarks.vs_llamacpp --smoke               # tiny random model, no peers, seconds (CI)

``--setup`` builds the peers (``benchmarks/llamacpp_setup.py``): llama-cpp-python 0.3.36 from its sdist into the
virtual environment ``.bench-env/llamacpp`` and ``llama-server`` from the same source, for this CPU's own
instructions, or with ``--isa avx2`` for AVX2 alone. ``--isa avx2`` on a run pairs that build with the engine capped
at AVX2, so an AVX-512 machine measures what an AVX2 laptop would.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, fmt, free_port, markdown_table, process_cpu_seconds, progress
from benchmarks.llamacpp_setup import (
    ENV_DIR,
    ISA_ENVIRONMENT,
    ISAS,
    apply_isa,
    env_python,
    peer_library_env,
    server_binary,
    setup,
)

PEER_SCRIPT = Path(__file__).resolve().with_name("vs_llamacpp_peer.py")
CONCURRENCY = 8
# The targets hold on AVX2 and on AVX-512 alike (``machine()["isa"]`` says which one a run had).
TARGET_C1 = 0.8  # ours / llama-cpp-python at concurrency 1
TARGET_C8 = 1.5  # ours / llama-server with 8 slots, 8 concurrent requests
TARGET_E2E_DECODE = 0.8  # up's decode tok/s / llama-server's, through the openai SDK at concurrency 1
TARGET_E2E_VS_ALONE = 0.85  # up's decode tok/s / the engine alone at concurrency 1

# Eight ordinary chat questions, as a person would type them into a chat box.
PROMPTS = (
    "What is the capital of France, and what is it famous for?",
    "Can you explain in simple terms how a rainbow forms?",
    "I have eggs, spinach and cheese. What could I cook for dinner tonight?",
    "Write a short, friendly email telling my team the meeting moved to Thursday.",
    "What are three tips for getting better sleep?",
    "How do I reverse a list in Python?",
    "Why is the sky blue during the day but red at sunset?",
    "Suggest a name for a small coffee shop near the sea.",
)


# ----------------------------------------------------------------------------------------------------------------
# The systems
# ----------------------------------------------------------------------------------------------------------------


def chat_prompts(tokenizer: Any, questions: Sequence[str] = PROMPTS) -> list[list[int]]:
    """Each question as one user turn with the model's chat template and the assistant's turn opened, as ids."""
    prompts = []
    for question in questions:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        ids = encoded if isinstance(encoded, list) else encoded["input_ids"]
        prompts.append([int(i) for i in ids])
    return prompts


@dataclass
class Measured:
    """One system's figures: tok/s per round, and the generated ids of its last round (one list per prompt)."""

    tok_s: list[float] = field(default_factory=list)
    # Cores other processes kept busy in the second before each measurement (the box is shared).
    busy_before: list[float | None] = field(default_factory=list)
    # Cores other processes kept busy, on average, while it ran: the box's busy time less this run's processes'.
    busy_during: list[float | None] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    error: str | None = None

    @property
    def best(self) -> float | None:
        return max(self.tok_s) if self.tok_s else None

    def as_json(self) -> dict[str, Any]:
        return {
            "tok_s": [round(v, 2) for v in self.tok_s],
            "best_tok_s": self.best,
            "busy_cores_before": [None if v is None else round(v, 2) for v in self.busy_before],
            "busy_cores_during": [None if v is None else round(v, 2) for v in self.busy_during],
            "error": self.error,
        }


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs since boot (Linux ``/proc/stat``)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


class OthersBusy:
    """Cores that processes other than ``pids`` kept busy between ``start`` and ``stop``: all CPUs' busy time
    (``/proc/stat``) less the CPU time of ``pids`` (all their threads), over the wall time; None off Linux."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self._start: tuple[float, float, float] | None = None

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            idle, total = _cpu_times()
            ours = sum(process_cpu_seconds(pid) for pid in self.pids)
        except (OSError, ValueError, IndexError):
            return None
        return (total - idle) / os.sysconf("SC_CLK_TCK"), ours, time.perf_counter()

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        others = (end[0] - self._start[0]) - (end[1] - self._start[1])
        return max(0.0, others / (end[2] - self._start[2]))


def busy_cores(interval_s: float = 1.0) -> float:
    """How many cores were busy over the next ``interval_s`` (this process sleeps meanwhile); 0 off Linux."""
    try:
        idle0, total0 = _cpu_times()
        time.sleep(interval_s)
        idle1, total1 = _cpu_times()
    except (OSError, ValueError, IndexError):
        return 0.0
    total = total1 - total0
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / total) if total > 0 else 0.0


def wait_quiet(max_wait_s: float, busy_max: float = 0.3) -> float:
    """Wait (at most ``max_wait_s``) for a second in which other processes keep fewer than ``busy_max`` cores busy:
    on a shared 2-core box one busy core halves a 2-thread run, and spinning thread barriers (OpenMP in torch and
    llama.cpp alike) lose far more than that. Returns the busy cores of the last second seen."""
    deadline = time.monotonic() + max_wait_s
    busy = busy_cores()
    while busy > busy_max and time.monotonic() < deadline:
        busy = busy_cores()
    return busy


class Ours:
    """The engine, one ``LLM`` per weight configuration."""

    def __init__(
        self,
        model: str,
        dtype: str,
        quantization: str | None,
        max_len: int,
        kv_blocks: int,
        compile_decode: bool,
        lm_head: str | None = None,
        int4_activations: str = "auto",
    ) -> None:
        from gpu_workers.engine import LLM, SamplingParams

        self.sampling_params = SamplingParams
        started = time.perf_counter()
        self.llm = LLM(
            model,
            dtype=dtype,
            quantization=quantization,
            max_model_len=max_len,
            num_kv_blocks=kv_blocks,
            max_num_seqs=CONCURRENCY,
            compile_cpu_decode=compile_decode,
            lm_head_quantization=lm_head,
            cpu_int4_activations=int4_activations,
        )
        self.load_s = time.perf_counter() - started

    def _params(self, tokens: int) -> Any:
        return self.sampling_params(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def warm_up(self, prompts: list[list[int]]) -> None:
        self.llm.generate(prompts, self._params(2))

    def c1(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        outputs, started = [], time.perf_counter()
        for prompt in prompts:
            outputs.append(list(self.llm.generate([prompt], self._params(tokens))[0].token_ids))
        return sum(map(len, outputs)) / (time.perf_counter() - started), outputs

    def concurrent(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        started = time.perf_counter()
        results = self.llm.generate(prompts, self._params(tokens))
        outputs = [list(r.token_ids) for r in results]
        return sum(map(len, outputs)) / (time.perf_counter() - started), outputs


class HFGenerate:
    """transformers ``generate`` on the Hugging Face folder the engine loads (the GGUF dequantized)."""

    def __init__(self, folder: Path, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        # As ignore_eos elsewhere: run past end-of-text and keep it as a token. (min_new_tokens would instead mask
        # it, so a model that ends early would be made to pick its second choice and differ from the engine.)
        self.pad_token_id = self.model.generation_config.eos_token_id
        self.model.generation_config.eos_token_id = None

    def _one(self, prompt: list[int], tokens: int) -> list[int]:
        ids = self.torch.tensor([prompt])
        with self.torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=self.torch.ones_like(ids),
                max_new_tokens=tokens,
                do_sample=False,
                pad_token_id=self.pad_token_id,
            )
        return [int(t) for t in out[0, len(prompt) :]]

    def c1(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        outputs, started = [], time.perf_counter()
        for prompt in prompts:
            outputs.append(self._one(prompt, tokens))
        return sum(map(len, outputs)) / (time.perf_counter() - started), outputs


class LlamaCppPython:
    """llama-cpp-python in the benchmark environment's Python, over ``vs_llamacpp_peer.py``'s JSON lines."""

    def __init__(self, model: Path, threads: int, n_ctx: int, env_dir: Path = ENV_DIR, isa: str = "native") -> None:
        python = env_python(env_dir)
        if not python.exists():
            raise RuntimeError(f"{python} is missing: run `python -m benchmarks.vs_llamacpp --setup` first")
        library = peer_library_env(env_dir, isa)
        if library and not Path(library["LLAMA_CPP_LIB_PATH"]).is_dir():
            setup_command = f"python -m benchmarks.vs_llamacpp --setup --isa {isa}"
            raise RuntimeError(f"no {isa} build of llama.cpp: run `{setup_command}` first")
        self.process = subprocess.Popen(
            [str(python), str(PEER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(threads), **library},
        )
        loaded = self._ask({"op": "load", "model": str(model), "threads": threads, "n_ctx": n_ctx})
        self.version, self.system_info = loaded["version"], loaded.get("system_info")

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"llama-cpp-python peer exited (status {self.process.wait()})")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"llama-cpp-python peer: {answer.get('error')}")
        return answer

    def warm_up(self, prompts: list[list[int]]) -> None:
        self._ask({"op": "run", "prompts": prompts, "tokens": 2})

    def c1(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        answer = self._ask({"op": "run", "prompts": prompts, "tokens": tokens})
        outputs = answer["tokens"]
        return sum(map(len, outputs)) / sum(answer["seconds"]), outputs

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self._ask({"op": "quit"})
            except (RuntimeError, OSError, json.JSONDecodeError):
                pass
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def server_command(binary: Path, model: Path, port: int, threads: int, slots: int, ctx: int) -> list[str]:
    """``llama-server`` with ``slots`` parallel slots sharing ``ctx`` tokens of KV cache, ``threads`` threads."""
    return [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--parallel",
        str(slots),
        "-c",
        str(ctx),
        "--no-webui",
    ]


class LlamaServer:
    """``llama-server`` as a subprocess, driven over HTTP by the standard library."""

    def __init__(
        self, model: Path, threads: int, slots: int, ctx: int, env_dir: Path = ENV_DIR, isa: str = "native"
    ) -> None:
        binary = server_binary(env_dir, isa)
        if not binary.exists():
            flag = "" if isa == "native" else f" --isa {isa}"
            raise RuntimeError(f"{binary} is missing: run `python -m benchmarks.vs_llamacpp --setup{flag}` first")
        self.port = free_port()
        self.log_path = env_dir / "llama-server.log"
        self.command = server_command(binary, model, self.port, threads, slots, ctx)
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(120.0)

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"llama-server not ready in {timeout_s:.0f} s; see {self.log_path}")

    def complete(self, prompt: list[int], tokens: int) -> list[int]:
        body = {
            "prompt": prompt,
            "n_predict": tokens,
            "temperature": 0.0,
            "top_k": 1,
            "ignore_eos": True,
            "cache_prompt": True,
            "return_tokens": True,
            "stream": False,
        }
        request = urllib.request.Request(
            self._url("/completion"), data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
        out = [int(t) for t in answer.get("tokens") or []]
        if len(out) != answer.get("tokens_predicted", len(out)):
            raise RuntimeError(f"llama-server returned {len(out)} tokens but predicted {answer['tokens_predicted']}")
        return out

    def concurrent(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            started = time.perf_counter()
            outputs = list(pool.map(lambda p: self.complete(p, tokens), prompts))
            seconds = time.perf_counter() - started
        return sum(map(len, outputs)) / seconds, outputs

    def warm_up(self, prompts: list[list[int]]) -> None:
        self.concurrent(prompts, 2)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


# ----------------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------------


def compare_outputs(ours: list[list[int]], peer: list[list[int]]) -> dict[str, Any]:
    """How many prompts' generated ids are equal, and the mean length of the common beginning."""
    prefixes = []
    for a, b in zip(ours, peer, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    equal = sum(a == b for a, b in zip(ours, peer, strict=True))
    return {"equal": equal, "of": len(ours), "mean_common_prefix": round(sum(prefixes) / max(1, len(prefixes)), 1)}


def ratio(ours: float | None, peer: float | None) -> float | None:
    return ours / peer if ours is not None and peer else None


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        # The vector ISA torch dispatches to (``ATEN_CPU_CAPABILITY=avx2`` gives AVX2 on an AVX-512 machine).
        "isa": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def label(dtype: str, quantization: str | None) -> str:
    return dtype if quantization is None else f"{dtype}, quantization={quantization}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started_at = datetime.datetime.now(datetime.UTC)
    temp: tempfile.TemporaryDirectory[str] | None = None
    if args.smoke:
        from gpu_workers.engine.models.random_checkpoint import make_tiny_model

        temp = tempfile.TemporaryDirectory(prefix="vs-llamacpp-smoke-")
        model_path = make_tiny_model(Path(temp.name) / "tiny", num_layers=2, hidden_size=64, vocab_size=512)
        hf_folder = model_path
        model_name = "tiny random-weight llama (2 layers, hidden 64)"
    else:
        from gpu_workers.engine.models.gguf_checkpoint import converted_folder
        from sluicegate.models.smollm2 import fetch_smollm2

        model_path = Path(args.model) if args.model else fetch_smollm2(REPO_ROOT / ".sluicegate" / "models")
        hf_folder = converted_folder(model_path)
        model_name = model_path.name
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    results: dict[str, Any] = {
        "smoke": args.smoke,
        "date": started_at.isoformat(timespec="seconds"),
        "model": model_name,
        "model_path": str(model_path),
        "machine": machine(),
        "load_before": [round(v, 2) for v in load_before],
        "workload": {
            "prompts": len(PROMPTS),
            "tokens": args.tokens,
            "threads": args.threads,
            "rounds": args.rounds,
            "quiet_wait_s": args.quiet_wait,
            "concurrency": [1, CONCURRENCY],
        },
        "quantization": args.quantization,
        "lm_head_quantization": args.lm_head_quantization or None,
        "cpu_int4_activations": args.cpu_int4_activations,
        "compile_cpu_decode": args.compile_cpu_decode,
        "isa_requested": args.isa,
        "isa_environment": ISA_ENVIRONMENT[args.isa],
    }
    try:
        _measure(args, results, model_path, hf_folder, dtypes)
    finally:
        if temp is not None:
            temp.cleanup()
    results["load_after"] = [round(v, 2) for v in os.getloadavg()]
    results["wall_s"] = round((datetime.datetime.now(datetime.UTC) - started_at).total_seconds(), 1)
    return results


def _measure(
    args: argparse.Namespace, results: dict[str, Any], model_path: Path, hf_folder: Path, dtypes: list[str]
) -> None:
    ours: dict[str, Ours] = {}
    for dtype in dtypes:
        progress(f"loading the engine ({label(dtype, args.quantization)}) ...")
        ours[dtype] = Ours(
            str(model_path), dtype, args.quantization, 1024, 512, args.compile_cpu_decode,
            args.lm_head_quantization or None, args.cpu_int4_activations,
        )  # fmt: skip
    prompts = chat_prompts(next(iter(ours.values())).llm.tokenizer)
    prompts_len = max(map(len, prompts))
    results["workload"]["prompt_tokens"] = [len(p) for p in prompts]
    results["ours_load_s"] = {d: round(e.load_s, 1) for d, e in ours.items()}
    for engine in ours.values():
        engine.warm_up(prompts)

    hf: dict[str, HFGenerate] = {}
    hf_error = None
    hf_dtypes = [] if args.skip_hf else [d.strip() for d in args.hf_dtype.split(",") if d.strip()]
    if hf_dtypes:
        try:
            for dtype in hf_dtypes:
                hf[dtype] = HFGenerate(hf_folder, dtype)
        except Exception as exc:  # a reference only: say why it is missing and go on
            hf_error = f"{type(exc).__name__}: {exc}"
            progress(f"transformers reference skipped: {hf_error}")
            hf = {}

    peer_c1: LlamaCppPython | None = None
    server: LlamaServer | None = None
    peer_errors: dict[str, str] = {}
    if not args.skip_peers:
        n_ctx = 256 * -(-(prompts_len + args.tokens + 16) // 256)
        try:
            progress("starting llama-cpp-python ...")
            peer_c1 = LlamaCppPython(model_path, args.threads, n_ctx, isa=args.isa)
            peer_c1.warm_up(prompts)
        except Exception as exc:
            peer_errors["llama_cpp_python"] = f"{type(exc).__name__}: {exc}"
            progress(f"llama-cpp-python failed: {peer_errors['llama_cpp_python']}")
            peer_c1 = None
        try:
            progress("starting llama-server ...")
            server = LlamaServer(model_path, args.threads, CONCURRENCY, CONCURRENCY * n_ctx, isa=args.isa)
            server.warm_up(prompts)
        except Exception as exc:
            peer_errors["llama_server"] = f"{type(exc).__name__}: {exc}"
            progress(f"llama-server failed: {peer_errors['llama_server']}")
            if server is not None:
                server.close()
            server = None

    measured: dict[str, Measured] = {}

    def record(key: str, fn: Callable[[], tuple[float, list[list[int]]]]) -> None:
        entry = measured.setdefault(key, Measured())
        if entry.error is not None:
            return
        busy = wait_quiet(args.quiet_wait) if args.quiet_wait > 0 else None
        others = OthersBusy([os.getpid()] + [p.process.pid for p in (peer_c1, server) if p is not None])
        others.start()
        try:
            tok_s, outputs = fn()
        except Exception as exc:
            entry.error = f"{type(exc).__name__}: {exc}"
            progress(f"{key} failed: {entry.error}")
            return
        during = others.stop()
        entry.tok_s.append(tok_s)
        entry.busy_before.append(busy)
        entry.busy_during.append(during)
        entry.outputs = outputs
        seen = "" if busy is None else f"; other processes busy on {busy:.2f} cores just before"
        seen += "" if during is None else f", {during:.2f} during"
        progress(f"  {key}: {tok_s:.1f} tok/s{seen}")

    try:
        for round_no in range(1, args.rounds + 1):
            progress(f"round {round_no}/{args.rounds} (load {os.getloadavg()[0]:.2f})")
            if peer_c1 is not None:
                record("llama_cpp_python c1", lambda: peer_c1.c1(prompts, args.tokens))
            for dtype, engine in ours.items():
                record(f"ours {dtype} c1", lambda e=engine: e.c1(prompts, args.tokens))
            if server is not None:
                record(f"llama_server c{CONCURRENCY}", lambda: server.concurrent(prompts, args.tokens))
            for dtype, engine in ours.items():
                record(f"ours {dtype} c{CONCURRENCY}", lambda e=engine: e.concurrent(prompts, args.tokens))
            for dtype, model in hf.items():
                record(f"hf_generate {dtype} c1", lambda m=model: m.c1(prompts, args.tokens))
    finally:
        if peer_c1 is not None:
            results["llama_cpp_python_version"] = peer_c1.version
            results["llama_cpp_system_info"] = peer_c1.system_info
            peer_c1.close()
        if server is not None:
            results["llama_server_command"] = shlex.join(server.command)
            server.close()

    results["peer_errors"] = peer_errors
    results["hf_error"] = hf_error
    results["measured"] = {key: m.as_json() for key, m in measured.items()}
    llama_c1 = measured.get("llama_cpp_python c1")
    server_c8 = measured.get(f"llama_server c{CONCURRENCY}")
    ratios: dict[str, Any] = {}
    equality: dict[str, Any] = {}
    for dtype in dtypes:
        c1, c8 = measured[f"ours {dtype} c1"], measured[f"ours {dtype} c{CONCURRENCY}"]
        ratios[dtype] = {
            "c1_vs_llama_cpp_python": ratio(c1.best, llama_c1.best if llama_c1 else None),
            f"c{CONCURRENCY}_vs_llama_server": ratio(c8.best, server_c8.best if server_c8 else None),
            "c1_vs_hf_generate": ratio(c1.best, measured[f"hf_generate {dtype} c1"].best)
            if f"hf_generate {dtype} c1" in measured
            else None,
        }
        eq: dict[str, Any] = {}
        if c1.outputs and c8.outputs:
            eq[f"ours c1 vs ours c{CONCURRENCY}"] = compare_outputs(c1.outputs, c8.outputs)
        for key in ("llama_cpp_python c1", f"llama_server c{CONCURRENCY}", f"hf_generate {dtype} c1"):
            if c1.outputs and key in measured and measured[key].outputs:
                eq[f"ours c1 vs {key}"] = compare_outputs(c1.outputs, measured[key].outputs)
        equality[dtype] = eq
    if llama_c1 and llama_c1.outputs and server_c8 and server_c8.outputs:
        equality["llama_cpp_python c1 vs llama_server"] = compare_outputs(llama_c1.outputs, server_c8.outputs)
    results["ratios"] = ratios
    results["outputs_equal"] = equality
    results["targets"] = [
        target
        for dtype in dtypes
        for target in (
            _target(f"{label(dtype, args.quantization)}: c=1 ours / llama-cpp-python", ratios[dtype], "c1", TARGET_C1),
            _target(
                f"{label(dtype, args.quantization)}: c={CONCURRENCY} ours / llama-server ({CONCURRENCY} slots)",
                ratios[dtype],
                f"c{CONCURRENCY}",
                TARGET_C8,
            ),
        )
    ]
    results["sample_texts"] = _sample_texts(ours, measured, dtypes)
    if args.e2e and not args.skip_peers:
        _measure_e2e(args, results, model_path, measured, dtypes)


def _measure_e2e(
    args: argparse.Namespace,
    results: dict[str, Any],
    model_path: Path,
    measured: dict[str, Measured],
    dtypes: list[str],
) -> None:
    """The whole stack against llama-server through the openai SDK (``vs_llamacpp_e2e.py``), after the engine's
    rounds (whose processes are gone by then), with its targets: decode >= 0.8x llama-server's, TTFT no worse, and
    decode >= 0.85x the engine alone at c=1 (its best round, prompt evaluation included)."""
    from benchmarks.vs_llamacpp_e2e import run_pair

    def start_peer() -> LlamaServer:
        return LlamaServer(model_path, args.threads, 1, 2048, isa=args.isa)

    note = f"llama-server -t {args.threads}; up's engine threads as up sets them (SLUICEGATE_TORCH_THREADS wins)"
    try:
        e2e = run_pair(start_peer, ENV_DIR, note, list(PROMPTS), args.tokens, args.e2e_passes)
    except Exception as exc:
        results["peer_errors"]["e2e"] = f"{type(exc).__name__}: {exc}"
        progress(f"e2e pair failed: {results['peer_errors']['e2e']}")
        return
    ours = e2e["runs"][1]["decode_tok_s_p50"]
    alone = ratio(ours, measured[f"ours {dtypes[-1]} c1"].best)
    e2e["decode_vs_engine_alone"] = alone
    results["e2e"] = e2e
    results["targets"] += [
        {"name": "e2e: up decode / llama-server decode", "value": e2e["decode_vs_llama_server"],
         "target": TARGET_E2E_DECODE, "met": e2e["decode_vs_llama_server"] >= TARGET_E2E_DECODE},
        {"name": f"e2e: up decode / engine alone c=1 ({dtypes[-1]})", "value": alone,
         "target": TARGET_E2E_VS_ALONE, "met": None if alone is None else alone >= TARGET_E2E_VS_ALONE},
        {"name": "e2e: llama-server TTFT p50 / up TTFT p50", "value": round(1 / e2e["ttft_vs_llama_server"], 3),
         "target": 1.0, "met": e2e["ttft_vs_llama_server"] <= 1.0},
    ]  # fmt: skip


def _target(name: str, ratios: dict[str, Any], which: str, target: float) -> dict[str, Any]:
    key = "c1_vs_llama_cpp_python" if which == "c1" else f"{which}_vs_llama_server"
    value = ratios[key]
    return {"name": name, "value": value, "target": target, "met": None if value is None else value >= target}


def _sample_texts(ours: dict[str, Ours], measured: dict[str, Measured], dtypes: list[str]) -> dict[str, str]:
    """The first prompt's answer from each system, decoded by the engine's tokenizer (same vocabulary)."""
    tokenizer = next(iter(ours.values())).llm.tokenizer
    return {
        key: tokenizer.decode(m.outputs[0], skip_special_tokens=True)
        for key, m in measured.items()
        if m.outputs and (not key.startswith("ours") or key.endswith(" c1"))
    }


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(results: dict[str, Any]) -> str:
    """The markdown a reader sees: what ran, one row per system, the ratios against the targets."""
    w = results["workload"]
    measured = results["measured"]
    lines = [
        f"## Ours vs llama.cpp on the CPU ({results['date']})",
        "",
        f"Model: {results['model']}; {w['prompts']} chat prompts ({', '.join(map(str, w.get('prompt_tokens', [])))} "
        f"tokens), {w['tokens']} greedy tokens each, {w['threads']} threads, {w['rounds']} round(s), interleaved.",
        f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores, torch's ISA "
        f"{results['machine'].get('isa', '?')}; load average (1, 5, 15 min) "
        f"before {results['load_before']}, after {results.get('load_after')}.",
    ]
    if results.get("isa_environment"):
        capped = f"{results['isa_requested']} ({results['isa_environment']})"
        lines.append(f"ISA capped for the engine and the peers' build: {capped}.")
    if results.get("llama_cpp_system_info"):
        lines.append(f"llama.cpp: {results['llama_cpp_system_info']}")
    if results["smoke"]:
        lines.append("Smoke run: tiny random-weight model, no peers; the figures mean nothing.")
    lines.append("")
    rows = []
    c8 = f"c{CONCURRENCY}"
    names = {
        "llama_cpp_python c1": (f"llama-cpp-python {results.get('llama_cpp_python_version', '')}".strip(), "GGUF", 1),
        f"llama_server {c8}": (f"llama-server, {CONCURRENCY} slots", "GGUF", CONCURRENCY),
    }
    for key, m in measured.items():
        if key in names:
            system, weights, conc = names[key]
        else:
            kind, dtype, c = key.split(" ")
            system = "ours (gpu_workers.engine)" if kind == "ours" else "transformers generate"
            weights = label(dtype, results["quantization"]) if kind == "ours" else dtype
            conc = int(c[1:])
        peer_key = "llama_cpp_python c1" if conc == 1 else f"llama_server {c8}"
        peer_best = measured.get(peer_key, {}).get("best_tok_s")
        vs = ratio(m["best_tok_s"], peer_best) if key != peer_key else None
        rows.append(
            [
                system,
                weights,
                str(conc),
                ", ".join(fmt(v) for v in m["tok_s"]) or "-",
                ", ".join(
                    f"{_opt(before)} / {_opt(during)}"
                    for before, during in zip(m["busy_cores_before"], m["busy_cores_during"], strict=True)
                )
                or "-",
                fmt(m["best_tok_s"]) if m["best_tok_s"] is not None else (m["error"] or "not measured"),
                "1.00 (peer)" if key == peer_key else (f"{vs:.2f}x" if vs is not None else "-"),
            ]
        )
    lines.append(
        markdown_table(
            [
                "system",
                "weights",
                "concurrency",
                "tok/s per round",
                "others' busy cores before / during",
                "best tok/s",
                "vs peer",
            ],
            rows,
        )
    )
    lines += ["", "Targets (best round against best round):"]
    for t in results["targets"]:
        verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "missed")
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}x"
        lines.append(f"- {t['name']}: {value} (target >= {t['target']}x): {verdict}")
    e2e = results.get("e2e")
    if e2e:
        lines += ["", f"End to end through the openai SDK, c=1 (`up` started in {e2e['up_start_s']} s):"]
        lines.append(
            markdown_table(
                ["system", "streams", "decode tok/s p50", "TTFT p50 ms"],
                [
                    [r["system"], str(r["streams"]), fmt(r["decode_tok_s_p50"]), fmt(r["ttft_ms_p50"])]
                    for r in e2e["runs"]
                ],
            )
        )
    lines += ["", "Greedy outputs, prompts with all ids equal (mean length of the equal beginning):"]
    for dtype, eq in results["outputs_equal"].items():
        pairs = {dtype: eq} if "equal" in eq else {f"{dtype}, {name}": c for name, c in eq.items()}
        for name, c in pairs.items():
            lines.append(f"- {name}: {c['equal']}/{c['of']} ({c['mean_common_prefix']})")
    for name, error in {**results.get("peer_errors", {}), "transformers": results.get("hf_error")}.items():
        if error:
            lines.append(f"- {name} not measured: {error}")
    return "\n".join(lines)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="only build/install the peers into .bench-env/llamacpp")
    parser.add_argument("--skip-peers", action="store_true", help="measure the engine (and transformers) only")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the transformers generate reference")
    parser.add_argument(
        "--hf-dtype",
        default="float32",
        help="dtypes of the transformers reference, comma-separated (default float32: on a busy 2-core box each "
        "costs minutes a round)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny random-weight model, no peers, a few seconds")
    parser.add_argument("--tokens", type=int, default=None, help="greedy tokens per prompt (default 64, smoke 8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32,bfloat16", help="the engine's dtypes, comma-separated")
    parser.add_argument(
        "--quantization", default=None, help="passed as is to the engine's LLM(quantization=...) (default: none)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds, best counts (default 3)")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help="before each measurement wait up to this many seconds for a second with the box idle (default 60, "
        "smoke 0)",
    )
    parser.add_argument("--model", default=None, help="GGUF file (default: the SmolLM2 Q4_1 the project fetches)")
    parser.add_argument(
        "--compile-cpu-decode",
        action="store_true",
        help="the engine's decode steps compiled (LLM(compile_cpu_decode=True), as `sluicegate up` serves)",
    )
    parser.add_argument(
        "--lm-head-quantization",
        default="",
        help="the engine's LM head: w8a8 (int8 weights and per-row int8 activations, as `sluicegate up` serves "
        "a kept-quantized model on the CPU) or empty (as the quantization leaves it)",
    )
    parser.add_argument(
        "--cpu-int4-activations",
        default="auto",
        help="the 4-bit layers' activations: auto (int8 where torch dispatches to AVX2, as `up` serves), int8, "
        "bfloat16",
    )
    parser.add_argument(
        "--e2e",
        action="store_true",
        help="then the whole stack (`sluicegate up`) against llama-server through the openai SDK, c=1",
    )
    parser.add_argument("--e2e-passes", type=int, default=2, help="passes over the prompts per e2e system")
    parser.add_argument(
        "--isa",
        choices=ISAS,
        default="native",
        help="avx2: both sides at AVX2 on a newer CPU: the engine (and `up` under --e2e) with every kernel library "
        "capped at AVX2, the peers from llama.cpp built without native flags (`--setup --isa avx2` builds them)",
    )
    parser.add_argument("--out", default="vs_llamacpp.json", help="where the JSON results go")
    args = parser.parse_args(argv)
    # A stop by signal unwinds like Ctrl-C, so the peer subprocesses are closed (a background job ignores SIGINT).
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, _raise_interrupt)
    if args.setup:
        done = setup(isa=args.isa)
        print(json.dumps(done, indent=2))
        return 0
    if args.smoke:
        args.skip_peers = True
        args.tokens = args.tokens or 8
        args.rounds = args.rounds or 1
        args.quiet_wait = 0.0 if args.quiet_wait is None else args.quiet_wait
    args.tokens = args.tokens or 64
    args.rounds = args.rounds or 3
    args.quiet_wait = 60.0 if args.quiet_wait is None else args.quiet_wait
    apply_isa(args.isa)  # before torch is imported: ATen reads its capability once
    results = run(args)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(report(results))
    print(f"\n(results in {args.out})")
    failed = results["peer_errors"] or any(m["error"] for k, m in results["measured"].items() if k.startswith("ours"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
