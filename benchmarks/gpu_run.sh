#!/usr/bin/env bash
# The engine on a real GPU in one prepared run: every GPU path checked, then measured.
#
# Phases, in priority order, each under its own time limit, each leaving its files in $OUT
# before the next starts (a run cut short keeps what it measured):
#   env     nvidia-smi and the versions of python, torch, triton, transformers, bitsandbytes, flash-attn
#   tests   the `gpu` tests of the engine (pytest -m gpu tests/unit/engine) -> gpu_tests.xml
#   parity  greedy tokens equal transformers for each GPU attention path (benchmarks/gpu_parity.py)
#   lora    the multi-LoRA Triton kernels against the per-token reference and through the engine (the LoRA unit
#           tests, which take CUDA when present), then benchmarks/lora_kernels.py timing them -> lora_tests.xml
#   bench   benchmarks/engine_gpu.py on the Llama-3.1-8B shape: floor, c=1 ITL, voice bot (1 and 64 first),
#           cascade off, prefix caching off, then FP8 / bnb / INT4 / FP8 KV / speculation / transformers
# summary.json says each phase's exit status and seconds; gpu_run.log holds everything printed.
#
# It runs from the source tree (PYTHONPATH=.) on the GPU image's own torch, triton and transformers.
# Missing pure-Python packages travel as wheels in .whl/ (pydantic for the tests' conftest), and
# unpacked packages in .whl/site/ (bitsandbytes trimmed to its CUDA 13 libraries); see docs/benchmarks.md.
#
# usage: bash benchmarks/gpu_run.sh [--smoke] [--only PHASES] [--budget-s S] [--skip BENCH_PHASES]
#   --smoke     rehearse every phase on the CPU with tiny models (tests then only collect and skip)
#   --only      comma-separated subset of env,tests,parity,lora,bench
#   --budget-s  engine_gpu.py's wall-clock budget (default 240)
#   --skip      passed to engine_gpu.py --skip (sweep, cascade_off, prefix_off, fp8, bnb-int8, bnb-nf4, awq, gptq,
#               ngram, draft_model, tp, lora, peers, kv_fp8)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

smoke=0 only=env,tests,parity,lora,bench budget=240 skip=""
while (($#)); do
    case $1 in
        --smoke) smoke=1 ;;
        --only) only=$2; shift ;;
        --budget-s) budget=$2; shift ;;
        --skip) skip=$2; shift ;;
        *) echo "usage: bash benchmarks/gpu_run.sh [--smoke] [--only PHASES] [--budget-s S] [--skip P,..]" >&2; exit 2 ;;
    esac
    shift
done

OUT=${OUT:-$PWD/.gpu_run}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$OUT/gpu_run.log") 2>&1

# The GPU image's python3 by default; PY names another interpreter (the tests pass their own, a venv's).
PY=${PY:-python3}
site=${TMPDIR:-/tmp}/sluicegate-gpu-site
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || echo "warning: carried wheels did not install"
fi
export PYTHONPATH="$PWD:$site:$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}"

summary="$OUT/summary.json"
echo '{}' >"$summary"
record() {  # phase, exit status, seconds
    "$PY" - "$summary" "$1" "$2" "$3" <<'EOF'
import json, sys
path, phase, rc, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
data = json.load(open(path))
data[phase] = {"rc": rc, "seconds": seconds, "timed_out": rc == 124}
json.dump(data, open(path, "w"), indent=1)
EOF
}
phase() {  # name, time limit (s), command...
    local name=$1 limit=$2 start rc
    shift 2
    [[ ",$only," == *",$name,"* ]] || return 0
    echo "=== [$(date +%T)] phase $name (limit ${limit} s): $*"
    start=$(date +%s)
    if declare -F "$1" >/dev/null; then  # a function of this script: timeout needs a process
        timeout --kill-after=10 "$limit" bash -c "PY=$PY OUT=$OUT; $(declare -f "$1"); \"\$@\"" "$1" "$@"
    else
        timeout --kill-after=10 "$limit" "$@"
    fi
    rc=$?
    echo "=== [$(date +%T)] phase $name: exit $rc after $(($(date +%s) - start)) s"
    record "$name" "$rc" "$(($(date +%s) - start))"
}

environment() {
    nvidia-smi || echo "no nvidia-smi"
    "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
for name in ("triton", "transformers", "bitsandbytes", "flash_attn", "pydantic", "safetensors", "tokenizers"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(name, "absent:", type(exc).__name__, str(exc)[:200])
EOF
}

lora_phase() {  # the LoRA kernels' tests (CUDA when present, else the interpreter's Triton or a skip), then timings
    "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/lora_tests.xml" \
        tests/unit/engine/test_lora_kernels.py tests/unit/engine/test_lora_layers.py
    local rc=$?
    "$PY" -m benchmarks.lora_kernels "$@" || rc=$?
    return $rc
}

if ((smoke)); then
    phase env 60 environment
    phase tests 300 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --continue-on-collection-errors --junitxml="$OUT/gpu_tests.xml" tests/unit/engine
    phase parity 300 "$PY" -m benchmarks.gpu_parity --smoke
    phase lora 300 lora_phase --rounds 1
    phase bench 300 "$PY" benchmarks/engine_gpu.py --smoke ${skip:+--skip "$skip"}
else
    # The generated 8B checkpoint (16 GB) goes to memory-backed /dev/shm when it has room, else to disk.
    model_dir=${TMPDIR:-/tmp}/sluicegate-gpu-model
    if [[ -d /dev/shm ]] && (($(df --output=avail -k /dev/shm | tail -1) > 40 * 1024 * 1024)); then
        model_dir=/dev/shm/sluicegate-gpu-model
    fi
    phase env 60 environment
    phase tests 180 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --continue-on-collection-errors --junitxml="$OUT/gpu_tests.xml" tests/unit/engine
    phase parity 90 "$PY" -m benchmarks.gpu_parity
    phase lora 120 lora_phase --device cuda
    phase bench $((budget + 90)) "$PY" benchmarks/engine_gpu.py --budget-s "$budget" --model-dir "$model_dir" \
        ${skip:+--skip "$skip"}
fi
echo "=== summary: $(tr -d '\n ' <"$summary")"
