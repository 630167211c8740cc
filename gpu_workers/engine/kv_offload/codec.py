"""One block's bytes in a tier: a fixed header (magic, format version, namespace, block hash, payload length) and
the K/V payload, closed by a checksum over both. Decoding checks every part, so a block of another namespace or
hash, or a damaged or truncated one, raises :class:`BlockDamaged` and the engine recomputes it instead."""

from __future__ import annotations

import hashlib
import struct

import torch

_MAGIC = b"SGKV"
_VERSION = 1
# magic, version, namespace (16), block hash (16), payload bytes
_HEADER = struct.Struct("<4sB16s16sQ")
_CHECKSUM_BYTES = 16


class BlockDamaged(ValueError):
    """A stored block that must not be used: damaged, truncated, or not the block asked for."""


def _checksum(header: bytes, payload: bytes | memoryview) -> bytes:
    digest = hashlib.blake2b(header, digest_size=_CHECKSUM_BYTES)
    digest.update(payload)
    return digest.digest()


def encode_block(namespace: bytes, block_hash: bytes, kv: torch.Tensor) -> bytes:
    """The stored form of one block's K/V (a CPU tensor of any dtype, read as raw bytes)."""
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = _HEADER.pack(_MAGIC, _VERSION, namespace, block_hash, len(payload))
    return header + payload + _checksum(header, payload)


def decode_block(
    data: bytes, namespace: bytes, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The K/V of a stored block as a CPU tensor of ``shape`` and ``dtype``; ``BlockDamaged`` unless every check
    holds."""
    if len(data) < _HEADER.size + _CHECKSUM_BYTES:
        raise BlockDamaged(f"stored block is {len(data)} bytes, shorter than its framing")
    header = data[: _HEADER.size]
    magic, version, stored_namespace, stored_hash, length = _HEADER.unpack(header)
    if magic != _MAGIC or version != _VERSION:
        raise BlockDamaged("stored block has an unknown format")
    if stored_namespace != namespace or stored_hash != block_hash:
        raise BlockDamaged("stored block belongs to another configuration or prefix")
    expected = 1
    for n in shape:
        expected *= n
    expected *= dtype.itemsize
    if length != expected or len(data) != _HEADER.size + length + _CHECKSUM_BYTES:
        raise BlockDamaged(f"stored block holds {len(data)} bytes, not the {expected} its shape needs")
    payload = memoryview(data)[_HEADER.size : _HEADER.size + length]
    if _checksum(header, payload) != data[-_CHECKSUM_BYTES:]:
        raise BlockDamaged("stored block fails its checksum")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
