#!/usr/bin/env bash
# The engine on a real GPU in one prepared run: every GPU path checked, then measured.
#
# Phases, in priority order, each under its own time limit and all under the run's deadline (--total-s, 540 s:
# a lent machine takes at most 10 minutes a command), each leaving its files in $OUT before the next starts (a run
# cut short keeps what it measured). Limits in seconds; the first seven sum to 535, lora and rest get what is left:
#   env       15  nvidia-smi and the versions of python, torch, triton, transformers, bitsandbytes, flash-attn
#   model     45  the Llama-3.1-8B-shaped random checkpoint and its AWQ copy (engine_gpu.py --build-only), written
#                 once for every later phase (/dev/shm when it has room)
#   profile  120  benchmarks/gpu_profile.py: the torch profiler over 50 decode steps at c=1 and c=64 in bf16, FP8
#                 and AWQ weights -> gpu_profile.json, gpu_profile.md, traces in gpu_run_files.tar
#   tests    120  the `gpu` tests of the engine (pytest -m gpu tests/unit/engine; 101 s on the H100)
#   parity    60  greedy tokens equal transformers for each GPU attention path (benchmarks/gpu_parity.py)
#   c1        90  engine_gpu.py --groups c1: the copy-bandwidth floor, c=1 decode ITL in bf16, FP8 and AWQ
#   voicebot  85  engine_gpu.py --groups voicebot: the voice bot at the A100 table's levels 1, 64, 8, 256
#   lora     120  the multi-LoRA Triton kernels against the per-token reference and through the engine (the LoRA
#                 unit tests, which take CUDA when present), then benchmarks/lora_kernels.py timing them
#   rest     480  engine_gpu.py --groups rest: the other voice-bot levels, cascade and prefix caching off, GPTQ,
#                 bitsandbytes, speculation, tensor parallelism, LoRA, transformers peers, FP8 KV cache
#   moe      150  low priority, last, skipped when the deadline leaves it no time (run it alone with --only moe):
#                 benchmarks/moe_gpu.py on 8 Mixtral-shaped layers (23.7 GB bf16, its own checkpoint): c=1 decode
#                 ITL and c=64 tok/s against the floor of bytes a step reads (attention + routed experts)
#                 -> moe_gpu.json in gpu_run_files.tar
#   archparity 120  lowest priority, after moe, skipped the same way (alone: --only archparity):
#                 benchmarks/arch_parity.py, greedy tokens against transformers for every architecture of the
#                 engine's registry (tiny random checkpoints, bf16 and fp32, torch and Triton backends) -> each
#                 architecture's pass / fail under "archparity" in summary.json, every case in arch_parity.json
#                 in gpu_run_files.tar
#   determinism 150  lowest priority, after archparity, skipped like it: the deterministic mode's cost on the dense
#                 checkpoint in bfloat16 (benchmarks/determinism.py cost: ITL and tok/s at c=1 and c=8, mode on
#                 against off, interleaved) -> determinism_gpu.json in gpu_run_files.tar
# The engine_gpu.py groups merge into one engine_gpu.json; after each, its target list (name, measured, goal,
# met, device, date) is copied to gpu_targets.json, which is kept in the repository as docs/gpu_targets.json.
#
# $OUT ends with at most 8 files (what a lent machine hands back): gpu_run.log (everything printed),
# summary.json (each phase's exit status and seconds, archparity's per-architecture verdicts; where the target
# list is), engine_gpu.json, gpu_targets.json, gpu_parity.json, gpu_profile.json, gpu_profile.md, and
# gpu_run_files.tar (the profiler's compressed chrome traces under profile_traces/, the tests' junit reports,
# moe_gpu.json and arch_parity.json), repacked after every phase.
#
# It runs from the source tree (PYTHONPATH=.) on the GPU image's own torch, triton and transformers.
# Missing pure-Python packages travel as wheels in .whl/ (pydantic for the tests' conftest), and
# unpacked packages in .whl/site/ (bitsandbytes trimmed to its CUDA 13 libraries); see docs/benchmarks.md.
#
# usage: bash benchmarks/gpu_run.sh [--smoke] [--only PHASES] [--total-s S] [--limit PHASE=S]... [--skip P,..]
#   --smoke     rehearse every phase on the CPU with tiny models (tests then only collect and skip)
#   --only      comma-separated subset of env,model,profile,tests,parity,c1,voicebot,lora,rest,moe,archparity,
#               determinism (a later phase finds the checkpoints of an earlier run's model phase in the same place, or
#               writes them)
#   --total-s   the run's deadline in seconds from its start (default 540; smoke 3600)
#   --limit     one phase's time limit, e.g. --limit rest=450 (still cut at the deadline)
#   --skip      passed to engine_gpu.py --skip (sweep, cascade_off, prefix_off, fp8, awq, gptq, bnb-int8, bnb-nf4,
#               ngram, draft_model, tp, lora, peers, kv_fp8)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

phases=env,model,profile,tests,parity,c1,voicebot,lora,rest,moe,archparity,determinism
usage="usage: bash benchmarks/gpu_run.sh [--smoke] [--only PHASES] [--total-s S] [--limit PHASE=S]... [--skip P,..]"
declare -A limits=([env]=15 [model]=45 [profile]=120 [tests]=120 [parity]=60 [c1]=90 [voicebot]=85 [lora]=120 [rest]=480 [moe]=150 [archparity]=120 [determinism]=150)
declare -A chosen=()  # --limit's, applied over the defaults below
smoke=0 only=$phases total="" skip=""
while (($#)); do
    case $1 in
        --smoke) smoke=1 ;;
        --only) only=$2; shift ;;
        --total-s) total=$2; shift ;;
        --limit)
            [[ $2 =~ ^([a-z0-9]+)=([0-9]+)$ && -n ${limits[${BASH_REMATCH[1]}]:-} ]] || { echo "$usage" >&2; exit 2; }
            chosen[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}; shift ;;
        --skip) skip=$2; shift ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
    shift
done
for name in ${only//,/ }; do
    [[ ",$phases," == *",$name,"* ]] || { echo "unknown phase $name; phases: $phases" >&2; exit 2; }
done
if ((smoke)); then
    # The CPU rehearsal is slower per step than the GPU and not bound by a lease: roomy limits.
    for name in "${!limits[@]}"; do limits[$name]=300; done
    total=${total:-3600}
else
    total=${total:-540}
fi
for name in "${!chosen[@]}"; do limits[$name]=${chosen[$name]}; done
run_start=$(date +%s)

OUT=${OUT:-$PWD/.gpu_run}
mkdir -p "$OUT"
# One OUT holds one run: the files of an earlier run would otherwise be merged into this one's.
rm -f "$OUT"/{summary.json,engine_gpu.json,gpu_targets.json,gpu_parity.json,gpu_profile.json,gpu_profile.md} \
    "$OUT"/gpu_run_files.tar "$OUT"/*.tmp
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

# The files beyond the eight above are staged here and packed into gpu_run_files.tar after every phase.
FILES=$(mktemp -d "${TMPDIR:-/tmp}/sluicegate-gpu-files.XXXXXX")
if ((smoke)); then
    MODEL_DIR=$(mktemp -d "${TMPDIR:-/tmp}/sluicegate-gpu-model.XXXXXX")/model
    trap 'rm -rf "$FILES" "$(dirname "$MODEL_DIR")"' EXIT
else
    # The generated 8B checkpoint (16 GB, 22 GB with its AWQ copy) goes to memory-backed /dev/shm when it has
    # room, else to disk; it stays for a later run on the same machine.
    MODEL_DIR=${TMPDIR:-/tmp}/sluicegate-gpu-model
    if [[ -d /dev/shm ]] && (($(df --output=avail -k /dev/shm | tail -1) > 40 * 1024 * 1024)); then
        MODEL_DIR=/dev/shm/sluicegate-gpu-model
    fi
    trap 'rm -rf "$FILES"' EXIT
fi
SMOKE=$smoke SKIP=$skip
export PY FILES MODEL_DIR SMOKE SKIP

summary="$OUT/summary.json"
echo '{}' >"$summary"
record() {  # phase, exit status ("" when skipped), seconds, note
    "$PY" - "$summary" "$@" <<'EOF'
import json, sys
path, phase, rc, seconds, note = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]
data = json.load(open(path))
mine = data.get(phase, {})  # what the phase itself wrote there (archparity: its per-architecture verdicts)
if rc:
    data[phase] = mine | {"rc": int(rc), "seconds": seconds, "timed_out": int(rc) in (124, 137)}
else:
    data[phase] = mine | {"rc": None, "seconds": 0.0, "timed_out": False, "skipped": note}
json.dump(data, open(path, "w"), indent=1)
EOF
}
copy_targets() {  # engine_gpu.json's target list -> gpu_targets.json, and where it goes into summary.json
    [[ -f $OUT/engine_gpu.json ]] || return 0
    "$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
results = json.loads((out / "engine_gpu.json").read_text())
targets = results.get("targets", [])
doc = {key: results.get(key) for key in ("device", "date", "smoke", "partial", "groups_run")}
(out / "gpu_targets.json").write_text(json.dumps({**doc, "targets": targets}, indent=1) + "\n")
summary = json.loads((out / "summary.json").read_text())
summary["targets"] = {
    "file": "gpu_targets.json",
    "keep_as": "docs/gpu_targets.json",
    "met": sum(t["met"] is True for t in targets),
    "missed": sum(t["met"] is False for t in targets),
    "not_measured": sum(t["measured"] is None for t in targets),
}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
EOF
}
pack_files() {  # the staged files -> $OUT/gpu_run_files.tar, replaced whole
    rm -f "$OUT"/*.tmp  # a phase killed mid-write leaves its staging file: never a ninth file in $OUT
    [[ -n $(ls -A "$FILES") ]] || return 0
    tar -cf "$OUT/gpu_run_files.tar.part" -C "$FILES" . && mv "$OUT/gpu_run_files.tar.part" "$OUT/gpu_run_files.tar"
}
phase() {  # name, command... (a function of this script or a program), under min(its limit, time to the deadline)
    local name=$1 limit left start rc
    shift
    [[ ",$only," == *",$name,"* ]] || return 0
    limit=${limits[$name]}
    left=$((run_start + total - $(date +%s)))
    if ((left < 20)); then  # not even a process start: say so rather than start it
        echo "=== [$(date +%T)] phase $name skipped: ${left} s left of the run's ${total} s"
        record "$name" "" 0 "run deadline: ${left} s left"
        return 0
    fi
    ((limit > left)) && limit=$left
    export PHASE_LIMIT=$limit
    echo "=== [$(date +%T)] phase $name (limit ${limit} s): $*"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    echo "=== [$(date +%T)] phase $name: exit $rc after $(($(date +%s) - start)) s"
    record "$name" "$rc" "$(($(date +%s) - start))" ""
    copy_targets  # after every phase: an engine_gpu.py group killed at its limit still left its figures
    pack_files
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
smoke_flag() { ((SMOKE)) && echo --smoke; }
inner_budget() {  # margin: the seconds a phase's own budget leaves before its limit to write its files (never <1/3)
    local margin=$1
    if ((PHASE_LIMIT > 3 * margin)); then echo $((PHASE_LIMIT - margin)); else echo $((PHASE_LIMIT * 2 / 3)); fi
}
model_phase() {
    "$PY" benchmarks/engine_gpu.py $(smoke_flag) --build-only --model-dir "$MODEL_DIR"
}
profile_phase() {  # its budget leaves time to write the last format's files before the limit
    "$PY" -m benchmarks.gpu_profile $(smoke_flag) --model-dir "$MODEL_DIR" --trace-dir "$FILES/profile_traces" \
        --trace-mb 1.5 --budget-s "$(inner_budget 25)"
}
tests_phase() {
    "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --continue-on-collection-errors \
        --junitxml="$FILES/gpu_tests.xml" tests/unit/engine
}
parity_phase() {
    "$PY" -m benchmarks.gpu_parity $(smoke_flag)
}
bench_group() {  # an engine_gpu.py group, merged into engine_gpu.json; its budget leaves time to write it
    "$PY" benchmarks/engine_gpu.py $(smoke_flag) --groups "$1" --merge --model-dir "$MODEL_DIR" \
        --budget-s "$(inner_budget 15)" ${SKIP:+--skip "$SKIP"}
}
lora_phase() {  # the LoRA kernels' tests (CUDA when present, else the interpreter's Triton or a skip), then timings
    "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$FILES/lora_tests.xml" \
        tests/unit/engine/test_lora_kernels.py tests/unit/engine/test_lora_layers.py
    local rc=$?
    if ((SMOKE)); then
        "$PY" -m benchmarks.lora_kernels --rounds 1 || rc=$?
    else
        "$PY" -m benchmarks.lora_kernels --device cuda || rc=$?
    fi
    return $rc
}
moe_phase() {  # its own Mixtral-shaped checkpoint, beside the dense one
    "$PY" -m benchmarks.moe_gpu $(smoke_flag) --model-dir "$(dirname "$MODEL_DIR")/sluicegate-moe-model" \
        --out "$FILES/moe_gpu.json"
}
archparity_phase() {  # every registered architecture against transformers; verdicts into summary.json
    "$PY" -m benchmarks.arch_parity $(smoke_flag) --out "$FILES/arch_parity.json" --summary "$OUT/summary.json"
}
determinism_phase() {  # the mode's Triton kernels on the GPU; the rehearsal runs the script on the CPU's mode
    local device=cuda rounds=2 tokens=48
    ((SMOKE)) && device=cpu rounds=1 tokens=8
    "$PY" -m benchmarks.determinism cost --device $device --model "$MODEL_DIR" --dtype bfloat16 --quantization "" \
        --rounds $rounds --tokens $tokens --out "$FILES/determinism_gpu.json"
}
export -f environment smoke_flag inner_budget model_phase profile_phase tests_phase parity_phase bench_group lora_phase \
    moe_phase archparity_phase determinism_phase

phase env bash -c environment
phase model bash -c model_phase
phase profile bash -c profile_phase
phase tests bash -c tests_phase
phase parity bash -c parity_phase
phase c1 bash -c 'bench_group c1'
phase voicebot bash -c 'bench_group voicebot'
phase lora bash -c lora_phase
phase rest bash -c 'bench_group rest'
phase moe bash -c moe_phase
phase archparity bash -c archparity_phase
phase determinism bash -c determinism_phase
echo "=== summary: $(tr -d '\n ' <"$summary")"
if [[ -f $OUT/gpu_targets.json ]]; then
    echo "=== targets: $OUT/gpu_targets.json -> keep in the repository as docs/gpu_targets.json"
fi
