"""Turns a GGUF checkpoint (llama.cpp's format) into the Hugging Face folder the loader reads.

``LLM("model.gguf")``, or a folder holding exactly one ``.gguf`` and no ``config.json``, goes through
``converted_folder``: once per file (keyed by its size and mtime) it writes ``config.json`` (from the GGUF
metadata), ``model.safetensors`` (every tensor dequantized by the ``gguf`` library's own dequantizer; llama.cpp's
Q/K row permutation undone for llama/mistral), the tokenizer files with the chat template (built by transformers
from the GGUF's tokenizer metadata), ``generation_config.json`` and ``gguf_tensors.json`` (where each tensor's
bytes lie in the file, for the kept-quantized loader), into ``<stem>.hf/`` beside the file (or a user cache folder
when that one is not writable), atomically and under a file lock. The existing loader then loads
that folder as any other. Architectures: llama, mistral, qwen2. Tensor types: ``SUPPORTED_TYPES``; any other,
a truncated or corrupt file, an unknown architecture or missing tokenizer metadata raise ``GGUFLoadError`` naming
the file and the reason, before anything is built.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .gguf_errors import GGUFLoadError

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when the folder layout changes: older cached folders are rebuilt
SOURCE_FILE = "gguf_source.json"


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names: itself if it is a ``.gguf`` file, the only ``.gguf`` of a folder without
    ``config.json``; None for anything else. A folder with several ``.gguf`` files is refused (which one?)."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(files) > 1:
        raise ValueError(f"model folder {str(path)!r} holds {len(files)} .gguf files; name one of them")
    return files[0] if files else None


def converted_folder(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The Hugging Face folder converted from ``gguf_path``, converting first if no current one is cached.

    ``cache_dir``: where the folder goes; by default beside the GGUF, else (not writable) the user cache."""
    source = Path(gguf_path).expanduser().resolve()
    if not source.is_file():
        raise GGUFLoadError(source, "no such file")
    target = _target_folder(source, cache_dir)
    key = _source_key(source)
    if _is_current(target, key):
        return target
    with _locked(target.with_name(target.name + ".lock")):
        if _is_current(target, key):  # another process converted it while this one waited
            return target
        log.info("converting GGUF %s into %s", source, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users of a shared cache
        try:
            # The gguf library is imported only when a GGUF is converted: the engine runs without it otherwise.
            from .gguf_convert import convert

            convert(source, tmp)
            (tmp / SOURCE_FILE).write_text(json.dumps(key, indent=2) + "\n")
            if target.exists():
                stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
                os.rename(target, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _target_folder(source: Path, cache_dir: str | Path | None) -> Path:
    name = f"{source.stem}.hf"
    if cache_dir is not None:
        folder = Path(cache_dir).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        return folder / name
    if os.access(source.parent, os.W_OK):
        return source.parent / name
    digest = hashlib.sha1(str(source).encode()).hexdigest()[:12]
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluicegate" / "gguf" / digest
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def _source_key(source: Path) -> dict[str, Any]:
    stat = source.stat()
    return {"gguf": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "converter": CONVERTER_VERSION}


def _is_current(target: Path, key: dict[str, Any]) -> bool:
    try:
        return json.loads((target / SOURCE_FILE).read_text()) == key
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
