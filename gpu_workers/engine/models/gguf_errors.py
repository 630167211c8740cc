"""The one error a GGUF checkpoint that cannot be loaded raises, whichever step finds the fault.

Finding the file and caching its converted folder (``gguf_checkpoint``), converting it (``gguf_convert``) and
reading its quantized tensors (``gguf_quantized``) all raise it; it lives apart from them so that each imports
it without importing another of them.
"""

from __future__ import annotations

from pathlib import Path


class GGUFLoadError(ValueError):
    """A GGUF file that cannot be loaded; the message names the file and the reason."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"GGUF file {path}: {reason}")
        self.path = Path(path)
        self.reason = reason
