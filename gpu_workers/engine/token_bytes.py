"""Each token's raw bytes, as the tokenizer writes them into the output before any UTF-8 decoding.

A token may hold part of a multi-byte UTF-8 character, so its text decoded on its own reads as U+FFFD; its bytes
do not. Byte-level BPE (GPT-2, Llama 3, Qwen) spells each byte as one printable character (the GPT-2 byte
map); SentencePiece spells bytes as ``<0xNN>`` tokens and a space as U+2581. Special and added tokens are
their text.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

#: SentencePiece's visible space.
SP_SPACE = "\u2581"


@lru_cache(maxsize=1)
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable character that stands for a byte back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_types(tokenizer: Any) -> set[str]:
    """The ``type`` names in a fast tokenizer's decoder (a Sequence decoder lists several)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return set()
    spec = json.loads(backend.to_str()).get("decoder") or {}
    found = {spec.get("type", "")}
    found.update(d.get("type", "") for d in spec.get("decoders") or [])
    return found


def _byte_of_sp_token(token: str) -> int | None:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def vocab_bytes(tokenizer: Any, size: int | None = None) -> list[bytes]:
    """Raw bytes of every token id below ``size`` (default: the tokenizer's length); ids the tokenizer does not
    know (a padded embedding) are empty."""
    size = len(tokenizer) if size is None else size
    strings = tokenizer.convert_ids_to_tokens(list(range(min(size, len(tokenizer)))))
    special = {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    decoder = gpt2_byte_decoder()
    byte_level = "ByteLevel" in _decoder_types(tokenizer)
    out: list[bytes] = []
    for token in strings:
        if token is None:
            out.append(b"")
        elif token in special:
            out.append(token.encode())
        elif byte_level and all(c in decoder for c in token):
            out.append(bytes(decoder[c] for c in token))
        elif (byte := _byte_of_sp_token(token)) is not None:
            out.append(bytes([byte]))
        else:
            out.append(token.replace(SP_SPACE, " ").encode())
    out += [b""] * (size - len(out))
    return out


class TokenBytes:
    """Raw bytes per token id, computed once per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._bytes = vocab_bytes(tokenizer)

    def __call__(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""
