"""The one adapter value callers hand the engine: which LoRA adapter a request (or ``add_lora``) names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter as vLLM names it: ``lora_name`` for people, ``lora_int_id`` (>= 1) for the engine, and
    ``lora_path``, a local folder holding ``adapter_config.json`` + ``adapter_model.safetensors`` (remote URLs are
    fetched to a local folder by the caller before the engine sees them).

    The id keys the engine's adapter pool and seeds the prefix cache's block hashes, so one id must always mean
    the same weights for the engine's life (the engine refuses an id seen before with another name or path).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty local folder path, got {self.lora_path!r}")
