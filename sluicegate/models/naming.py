"""Public model names: what a model is called in topics, heartbeats and ``/v1/models`` when nobody names it."""

from __future__ import annotations

from pathlib import Path


def default_public_name(model: str) -> str:
    """The public name of ``model`` (a folder, a ``.gguf`` file or a hub id) when none is given.

    A GGUF file, or a folder whose only checkpoint is one ``.gguf`` (no ``config.json``), is named after the file's
    stem, lower-cased (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct.q4_1``); anything else after
    its last path part, as it is (``/models/Qwen2.5-7B-Instruct`` -> ``Qwen2.5-7B-Instruct``).
    """
    gguf = gguf_checkpoint(model)
    return gguf.stem.lower() if gguf is not None else Path(model.rstrip("/")).expanduser().name


def gguf_checkpoint(model: str) -> Path | None:
    """The GGUF file ``model`` stands for: itself when it names a ``.gguf`` file, the folder's only ``.gguf`` when
    it is a folder with no ``config.json``; None for anything else (a Hugging Face folder or a hub id)."""
    path = Path(model.rstrip("/")).expanduser()
    if path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = [p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf"]
        if len(files) == 1:
            return files[0]
    return None
