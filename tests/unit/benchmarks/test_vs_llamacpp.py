"""``benchmarks.vs_llamacpp`` stays runnable between real runs: its smoke path end to end (tiny random model, the
engine and transformers, no peers), and its plumbing to the peers against stand-ins (a fake ``llama_cpp`` module
behind the JSON-lines peer script, a fake ``llama-server`` answering ``/health`` and ``/completion``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import llamacpp_setup, vs_llamacpp  # noqa: E402

FAKE_LLAMA_CPP = """
import os

__version__ = "0.0-fake"


def llama_print_system_info():
    # The real bindings load libllama from LLAMA_CPP_LIB_PATH when it is set: say which one this would be.
    return ("CPU : AVX512 = 1 | lib=" + os.environ.get("LLAMA_CPP_LIB_PATH", "own")).encode()


class Llama:
    def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, n_gpu_layers, verbose):
        assert n_threads == n_threads_batch == 2 and n_ctx >= 64
        self.model_path = model_path

    def generate(self, tokens, temp, top_k, top_p, min_p, repeat_penalty):
        assert temp == 0.0
        step = 0
        while True:  # the real generate never stops by itself either
            step += 1
            yield (sum(tokens) + step) % 100

    def detokenize(self, ids):
        return " ".join(map(str, ids)).encode()
"""

FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
assert args[args.index("--parallel") + 1] == "8" and args[args.index("-t") + 1] == "2"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0.0 and body["ignore_eos"] and body["return_tokens"]
        tokens = [(sum(body["prompt"]) + i + 1) % 100 for i in range(body["n_predict"])]
        self._send({"content": "", "tokens": tokens, "tokens_predicted": len(tokens)})


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for ``.bench-env/llamacpp``: its python is this one (with a fake ``llama_cpp`` importable), its
    ``llama-server`` a small HTTP server."""
    env_dir = tmp_path / "env"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").symlink_to(sys.executable)
    fake_pkg = tmp_path / "fakes" / "llama_cpp"
    fake_pkg.mkdir(parents=True)
    (fake_pkg / "__init__.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", str(fake_pkg.parent))
    server = env_dir / "bin" / "llama-server"
    server.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_SERVER))
    server.chmod(0o755)
    return env_dir


def test_the_peers_are_driven_as_the_benchmark_expects(fake_env: Path, tmp_path: Path) -> None:
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11], [12, 13], [14], [15, 16]]
    expected = [[(sum(p) + i + 1) % 100 for i in range(5)] for p in prompts]

    peer = vs_llamacpp.LlamaCppPython(tmp_path / "model.gguf", threads=2, n_ctx=256, env_dir=fake_env)
    try:
        assert peer.version == "0.0-fake" and "AVX512" in peer.system_info
        peer.warm_up(prompts)
        tok_s, outputs = peer.c1(prompts, 5)
    finally:
        peer.close()
    assert peer.process.returncode == 0
    assert outputs == expected and tok_s > 0

    server = vs_llamacpp.LlamaServer(tmp_path / "model.gguf", threads=2, slots=8, ctx=2048, env_dir=fake_env)
    try:
        server.warm_up(prompts)
        tok_s, outputs = server.concurrent(prompts, 5)
    finally:
        server.close()
    assert outputs == expected and tok_s > 0
    assert "--no-webui" in server.command and server.command[server.command.index("-c") + 1] == "2048"


def test_a_missing_environment_says_to_run_setup(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="--setup"):
        vs_llamacpp.LlamaCppPython(tmp_path / "m.gguf", threads=2, n_ctx=256, env_dir=tmp_path / "none")
    with pytest.raises(RuntimeError, match="--setup"):
        vs_llamacpp.LlamaServer(tmp_path / "m.gguf", threads=2, slots=8, ctx=2048, env_dir=tmp_path / "none")


def test_outputs_are_compared_by_their_equal_beginning() -> None:
    assert vs_llamacpp.compare_outputs([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == {
        "equal": 1,
        "of": 2,
        "mean_common_prefix": 2.0,
    }


def test_the_server_build_leaves_out_network_and_ui() -> None:
    for isa in llamacpp_setup.ISAS:
        args = llamacpp_setup.server_cmake_args(isa=isa)
        for option in ("-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"):
            assert option in args


def test_the_avx2_build_has_no_native_or_avx512_instructions() -> None:
    args = llamacpp_setup.server_cmake_args(isa="avx2")
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX2=ON" in args and "-DGGML_AVX512=OFF" in args
    # Shared, so that llama-cpp-python's bindings can load this build's libllama.
    assert "-DBUILD_SHARED_LIBS=ON" in args and "-DGGML_NATIVE=ON" not in args
    assert "-DGGML_NATIVE=ON" in llamacpp_setup.server_cmake_args(isa="native")
    with pytest.raises(ValueError, match="unknown ISA 'avx3'"):
        llamacpp_setup.server_cmake_args(isa="avx3")


def test_the_avx2_peers_run_the_avx2_build(fake_env: Path, tmp_path: Path) -> None:
    prompts = [[1, 2, 3], [4, 5]]
    with pytest.raises(RuntimeError, match="--setup --isa avx2"):
        vs_llamacpp.LlamaCppPython(tmp_path / "model.gguf", threads=2, n_ctx=256, env_dir=fake_env, isa="avx2")
    with pytest.raises(RuntimeError, match="--setup --isa avx2"):
        vs_llamacpp.LlamaServer(tmp_path / "m.gguf", threads=2, slots=8, ctx=2048, env_dir=fake_env, isa="avx2")
    avx2_bin = fake_env / "avx2-build" / "bin"
    avx2_bin.mkdir(parents=True)
    (avx2_bin / "llama-server").symlink_to(fake_env / "bin" / "llama-server")

    peer = vs_llamacpp.LlamaCppPython(tmp_path / "model.gguf", threads=2, n_ctx=256, env_dir=fake_env, isa="avx2")
    try:
        assert peer.system_info.endswith(f"lib={avx2_bin}")
    finally:
        peer.close()
    server = vs_llamacpp.LlamaServer(tmp_path / "m.gguf", threads=2, slots=8, ctx=2048, env_dir=fake_env, isa="avx2")
    try:
        assert server.command[0] == str(avx2_bin / "llama-server")
        assert server.concurrent(prompts, 3)[1] == [[(sum(p) + i + 1) % 100 for i in range(3)] for p in prompts]
    finally:
        server.close()


def test_the_avx2_cap_reaches_torch_and_the_engine_choices() -> None:
    """In a fresh interpreter (ATen reads its capability once): torch dispatches to AVX2, and the int4 layers choose
    as on an AVX2 machine (no bfloat16 unpacking even where the CPU has AVX512_BF16)."""
    code = (
        "from benchmarks.llamacpp_setup import apply_isa; apply_isa('avx2'); import os, torch; "
        "from gpu_workers.engine.quantization import cpu_linear as c; "
        "print(torch.backends.cpu.get_cpu_capability(), c.DENSE_DTYPE, c.DENSE_MIN_ROWS, "
        "os.environ['FBGEMM_ENABLE_INSTRUCTIONS'], os.environ['ONEDNN_MAX_CPU_ISA'])"
    )
    env = {k: v for k, v in os.environ.items() if k not in llamacpp_setup.ISA_ENVIRONMENT["avx2"]}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env={**env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["AVX2", "torch.float32", "128", "AVX2", "AVX2"]


def test_the_isa_cannot_change_under_a_loaded_torch() -> None:
    import torch

    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("this CPU runs AVX2 already")
    with pytest.raises(RuntimeError, match="already loaded"):
        llamacpp_setup.apply_isa("avx2")


def test_smoke_run_end_to_end(tmp_path: Path) -> None:
    """The smoke path: tiny random model, both dtypes, transformers as the reference, no peers; the JSON and the
    table come out, and no target is claimed since no peer was measured."""
    out = tmp_path / "vs.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_llamacpp", "--smoke", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "## Ours vs llama.cpp on the CPU" in done.stdout and "Targets" in done.stdout
    results = json.loads(out.read_text())
    assert results["smoke"] is True and results["peer_errors"] == {}
    measured = results["measured"]
    for key in ("ours float32 c1", "ours float32 c8", "ours bfloat16 c1", "ours bfloat16 c8", "hf_generate float32 c1"):
        assert measured[key]["best_tok_s"] > 0, key
        # No quiet wait in a smoke run; the other processes' load while it ran is still recorded.
        assert measured[key]["busy_cores_before"] == [None] and measured[key]["busy_cores_during"][0] >= 0, key
    assert all(t["met"] is None for t in results["targets"])
    # The run names the ISA torch dispatched to, in the JSON and in the table.
    isa = results["machine"]["isa"]
    assert isa and f"torch's ISA {isa}" in done.stdout
    # Greedy float32 output of the engine equals transformers', and does not depend on the batch.
    assert results["outputs_equal"]["float32"]["ours c1 vs hf_generate float32 c1"]["equal"] == 8
    assert results["outputs_equal"]["float32"]["ours c1 vs ours c8"]["equal"] == 8
