"""A LoRA adapter's files on local disk: a local folder as it is, an fsspec URL fetched once into the worker's cache.

The engine reads adapters from local folders only (``LoRARequest.lora_path``), while the registry may name any
URL every worker can read (``s3://...``, ``gs://...``, ``memory://...``). Only the two files a PEFT LoRA adapter
needs are fetched (``adapter_config.json`` and ``adapter_model.safetensors``), into a temporary folder that is
renamed into place once complete, so a crash mid-fetch never leaves a half adapter that looks whole. Everything
here blocks (disk and network): callers run it in a thread.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import fsspec

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class AdapterFetchError(OSError):
    """The adapter's files could not be read from where the registry says they are (one line)."""


def is_remote(path: str) -> bool:
    """True for an fsspec URL other than ``file://`` (those are fetched); False for a local path."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() != "file"


def local_path(path: str) -> str:
    """A local path or ``file://`` URL as a plain local path."""
    return path[len("file://") :] if path.lower().startswith("file://") else path


def cache_entry(cache_dir: Path, url: str, tag: str) -> Path:
    """Where the adapter at ``url`` is cached: one folder per (``tag``, URL), readable in a listing."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return cache_dir / f"{tag}-{digest}"


def fetch_adapter(path: str, cache_dir: Path, tag: str) -> Path:
    """The local folder holding the adapter at ``path``: itself when local, else its cached copy, fetched if absent.

    ``tag`` keeps registrations apart (the adapter's ``lora_int_id``): a name registered again at the same URL
    gets a new id and therefore a fresh copy, never the old registration's files.
    """
    if not is_remote(path):
        return Path(local_path(path)).expanduser()
    target = cache_entry(cache_dir, path, tag)
    if all((target / name).is_file() for name in ADAPTER_FILES):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
    try:
        try:
            fs, root = fsspec.core.url_to_fs(path)
        except (ImportError, ValueError) as exc:  # an unknown protocol, or one whose package is not installed
            raise AdapterFetchError(f"cannot open adapter URL {path!r}: {exc}") from exc
        root = root.rstrip("/")
        for name in ADAPTER_FILES:
            remote = f"{root}/{name}"
            try:
                fs.get_file(remote, str(staging / name))
            except FileNotFoundError as exc:
                raise AdapterFetchError(f"adapter URL {path!r} has no {name}") from exc
            except Exception as exc:  # network, auth, permissions: whatever the backend raises
                raise AdapterFetchError(f"cannot fetch {name} of adapter URL {path!r}: {exc!r}") from exc
        if target.exists():  # an incomplete copy (not made by this code, which renames only whole ones)
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)  # atomic: another fetch of the same adapter may have won, which is fine
        except OSError:
            if not all((target / name).is_file() for name in ADAPTER_FILES):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
