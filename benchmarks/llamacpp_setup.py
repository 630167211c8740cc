"""The llama.cpp peers' own environment for ``benchmarks.vs_llamacpp``: llama-cpp-python and ``llama-server``, built
from one pinned sdist, for the CPU's own instruction sets or for AVX2 alone.

- ``native``: llama-cpp-python 0.3.36 installed from its sdist with pip (cmake compiles llama.cpp with
  ``GGML_NATIVE=ON``) into the virtual environment ``.bench-env/llamacpp``, and a static ``llama-server`` from that
  sdist's ``vendor/llama.cpp`` into ``.bench-env/llamacpp/bin``.
- ``avx2``: the same vendored source built without native flags, AVX2 / FMA / F16C / BMI2 and nothing of AVX-512,
  as shared libraries plus ``llama-server`` in ``.bench-env/llamacpp/avx2-build/bin``. llama-cpp-python's bindings
  load that ``libllama`` through ``LLAMA_CPP_LIB_PATH``, so one Python package serves both builds.

On an AVX-512 machine the AVX2 pair is what an AVX2 laptop would see: the engine's side runs with
``ISA_ENVIRONMENT["avx2"]``, which caps every kernel library torch uses at AVX2 (ATen's dispatch and Inductor's
generated code through ``ATEN_CPU_CAPABILITY``, fbgemm's integer GEMMs, oneDNN's GEMMs).

The environment needs the package index (PyPI) once and never touches the project's own environment.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, progress

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
ENV_DIR = REPO_ROOT / ".bench-env" / "llamacpp"
ISAS = ("native", "avx2")
# What the engine's process and its children get for each ISA. Each library picks its own instructions: ATen and
# Inductor read ATEN_CPU_CAPABILITY, fbgemm (the W8A8 LM head) FBGEMM_ENABLE_INSTRUCTIONS, oneDNN (bf16 / fp32
# GEMMs) ONEDNN_MAX_CPU_ISA. Without the last two an "AVX2" run would still take AVX-512 VNNI integer products.
ISA_ENVIRONMENT: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
_AVX2_GGML = [
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF",
    "-DGGML_AVX512_VBMI=OFF",
    "-DGGML_AVX512_VNNI=OFF",
    "-DGGML_AVX512_BF16=OFF",
    "-DGGML_AVX_VNNI=OFF",
]


def _check_isa(isa: str) -> None:
    if isa not in ISAS:
        raise ValueError(f"unknown ISA {isa!r}: use one of {', '.join(ISAS)}")


def apply_isa(isa: str) -> None:
    """Cap this process (and what it starts) at ``isa``'s instructions. Must run before torch is imported: ATen
    reads its capability once. Raises ``RuntimeError`` when torch is already loaded with another one."""
    _check_isa(isa)
    wanted = ISA_ENVIRONMENT[isa]
    torch = sys.modules.get("torch")
    if torch is not None and wanted:
        have = torch.backends.cpu.get_cpu_capability()
        if have.lower() != wanted["ATEN_CPU_CAPABILITY"]:
            raise RuntimeError(f"torch is already loaded with the {have} ISA; set {wanted} before it is imported")
    os.environ.update(wanted)


def env_python(env_dir: Path = ENV_DIR) -> Path:
    return env_dir / "bin" / "python"


def build_dir(env_dir: Path, isa: str) -> Path:
    """Where the ``isa`` build of llama.cpp lives (the native static ``llama-server`` is built in its own)."""
    _check_isa(isa)
    return env_dir / ("server-build" if isa == "native" else f"{isa}-build")


def server_binary(env_dir: Path = ENV_DIR, isa: str = "native") -> Path:
    _check_isa(isa)
    return env_dir / "bin" / "llama-server" if isa == "native" else build_dir(env_dir, isa) / "bin" / "llama-server"


def peer_library_env(env_dir: Path = ENV_DIR, isa: str = "native") -> dict[str, str]:
    """Environment for llama-cpp-python to load the ``isa`` build's ``libllama`` (nothing for its own native one)."""
    _check_isa(isa)
    return {} if isa == "native" else {"LLAMA_CPP_LIB_PATH": str(build_dir(env_dir, isa) / "bin")}


def installed_llama_cpp_version(env_dir: Path = ENV_DIR) -> str | None:
    """llama-cpp-python's version in the benchmark environment, None when it is not there or does not import."""
    python = env_python(env_dir)
    if not python.exists():
        return None
    done = subprocess.run(
        [str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def server_cmake_args(build_type: str = "Release", isa: str = "native") -> list[str]:
    """cmake options for ``llama-server``: CPU only, no curl/openssl, no web UI (its prebuilt assets would be
    downloaded from Hugging Face). Native: the CPU's own instructions, static so the binary stands alone. AVX2: no
    native flags and no AVX-512, shared so llama-cpp-python loads the same ``libllama``."""
    _check_isa(isa)
    common = [
        f"-DCMAKE_BUILD_TYPE={build_type}",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
    ]
    if isa == "native":
        return [*common, "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"]
    return [*common, *_AVX2_GGML, "-DBUILD_SHARED_LIBS=ON"]


def setup(env_dir: Path = ENV_DIR, jobs: int | None = None, isa: str = "native") -> dict[str, Any]:
    """Build the peers into ``env_dir`` (idempotent: a step whose result is there already is skipped). Returns the
    commands run and their seconds; raises ``subprocess.CalledProcessError`` when one fails. llama-cpp-python's
    package is installed for every ISA: an ``isa`` build only adds its own libraries and server."""
    _check_isa(isa)
    jobs = jobs or os.cpu_count() or 2
    steps: list[dict[str, Any]] = []
    build_env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}

    def run(name: str, command: Sequence[str | Path], env: dict[str, str] | None = None, **extra: str) -> None:
        command = [str(c) for c in command]
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
        progress(f"[setup] {name}: {(shown + ' ') if shown else ''}{shlex.join(command)}")
        started = time.perf_counter()
        subprocess.run(command, check=True, env={**(env or os.environ), **extra})
        seconds = time.perf_counter() - started
        steps.append({"step": name, "command": shlex.join(command), "env": extra, "seconds": round(seconds, 1)})
        progress(f"[setup] {name}: {seconds:.0f} s")

    python = env_python(env_dir)
    if not python.exists():
        run("venv", [sys.executable, "-m", "venv", env_dir])
    src = env_dir / "src"
    sdist = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        src.mkdir(parents=True, exist_ok=True)
        pip_download = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps"]
        run(
            "download sdist",
            [*pip_download, "--no-binary", ":all:", "-d", src, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
        )
    if installed_llama_cpp_version(env_dir) != LLAMA_CPP_PYTHON_VERSION:
        # Multimodal (llava/mtmd) is not used: not building it saves a third of the compile.
        run(
            "llama-cpp-python",
            [python, "-m", "pip", "install", "--disable-pip-version-check", sdist],
            env=build_env,
            CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON",
        )
    binary = server_binary(env_dir, isa)
    if not binary.exists():
        source = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
        if not (source / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
            with tarfile.open(sdist) as archive:
                archive.extractall(src, filter="data")
        build = build_dir(env_dir, isa)
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        targets = ["llama-server"] if isa == "native" else ["llama", "llama-server"]
        run(
            f"llama.cpp configure ({isa})",
            ["cmake", "-S", source / "vendor" / "llama.cpp", "-B", build, *generator, *server_cmake_args(isa=isa)],
        )
        run(f"llama.cpp build ({isa})", ["cmake", "--build", build, "--target", *targets, "-j", str(jobs)])
        if isa == "native":
            shutil.copy2(build / "bin" / "llama-server", binary)
    return {
        "env_dir": str(env_dir),
        "isa": isa,
        "llama_cpp_python": installed_llama_cpp_version(env_dir),
        "llama_server": str(binary),
        "library_env": peer_library_env(env_dir, isa),
        "steps": steps,
    }
