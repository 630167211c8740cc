"""Compile (not run) the Triton attention kernels for sm_90 through their real host launchers, with CPU tensors
standing in for CUDA ones, and report each variant's registers, spill stack and shared memory.

The interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute but not whether they compile for a GPU, nor
how: ``tl.dot`` shape rules, register spills and value specialisations only show in a real compile. This runs one
on a machine without a GPU. It replaces ``JITFunction.run`` with Triton's own argument binding plus
``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` (ptxas and cuobjdump ship with Triton), so it leans on Triton
internals: when those moved, it exits with code 77 and says so.

Usage: ``python3 tests/unit/engine/attention/sm90_compile.py [quick]`` (``quick``: bf16, one head shape, head
dims 128 and 256). Exits 1 when a variant fails to compile or a half-precision variant spills registers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import torch
import triton

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as tcompile
    from triton.runtime import jit as tjit

    tjit.create_function_from_signature  # noqa: B018
    tjit.JITFunction._pack_args  # noqa: B018
except (ImportError, AttributeError) as exc:
    print(f"triton {triton.__version__} internals this check uses are gone: {exc!r}")
    sys.exit(77)

from gpu_workers.engine.attention import triton_kernels as tk
from gpu_workers.engine.attention.metadata import AttentionMetadata

assert not tk.INTERPRETED
TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
RESULTS: list[tuple[str, str]] = []
SEEN: dict[str, str] = {}
CASE = [""]


def fake_run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> None:
    kwargs["debug"] = False
    binder = tjit.create_function_from_signature(self.signature, self.params, BACKEND)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound_args, specialization, options)
    key = repr((self.fn.__name__, signature, sorted((k, str(v)) for k, v in constexprs.items()), attrs))
    g = grid if isinstance(grid, tuple) else grid({})
    for d in g[1:]:
        assert d < 65536, f"grid dim {d} too large"
    if key in SEEN:
        return None
    try:
        kernel = tcompile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+).*?SHARED:(\d+)", usage)
        spill = re.search(r"STACK:(\d+)", usage)
        info = (
            f"ok regs={m.group(1) if m else '?'} stack={spill.group(1) if spill else '?'} "
            f"shared={kernel.metadata.shared} warps={kernel.metadata.num_warps} stages={kernel.metadata.num_stages}"
        )
    except Exception as exc:
        info = "FAIL " + "".join(traceback.format_exception_only(exc)).strip()[-3000:]
    SEEN[key] = info
    RESULTS.append((f"{self.fn.__name__} [{CASE[0]}]", info))
    print(RESULTS[-1][0], info, flush=True)
    return None


tjit.JITFunction.run = fake_run
tk._check_device = lambda *a: None


def make_meta(
    q_lens: list[int], seq_lens: list[int], block_size: int, cascade_len: int = 0, device_prefix: bool = False
) -> AttentionMetadata:
    n = len(q_lens)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    bt = torch.arange(n * max_blocks, dtype=torch.int32).view(n, max_blocks)
    return AttentionMetadata(
        slot_mapping=torch.arange(sum(q_lens), dtype=torch.int64),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=bt,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        is_decode_only=max(q_lens) == 1,
        common_prefix_len=cascade_len,
        common_prefix_len_device=torch.tensor([cascade_len], dtype=torch.int32) if device_prefix else None,
    )


def case(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    q_lens: list[int],
    seq_lens: list[int],
    splits: int,
) -> None:
    CASE[0] = f"{dtype} h={heads}/{kv_heads} d={head_dim} bs={block_size} q={q_lens[:3]} splits={splits}"
    t = sum(q_lens)
    q = torch.empty(t, heads * 3, head_dim, dtype=dtype)[:, :heads]  # strided view like a qkv split
    k = torch.empty(t, kv_heads, head_dim, dtype=dtype)
    v = torch.empty(t, kv_heads, head_dim, dtype=dtype)
    nblocks = sum(-(-s // block_size) for s in seq_lens) + 1
    kc = torch.empty(nblocks, block_size, kv_heads, head_dim, dtype=dtype)
    vc = torch.empty_like(kc)
    meta = make_meta(q_lens, seq_lens, block_size)
    tk.store_kvcache(k, v, kc, vc, meta.slot_mapping)
    tk.paged_attention(q, kc, vc, meta, 0.1, num_splits=splits)
    if len(q_lens) >= 2 and min(s - ql for s, ql in zip(seq_lens, q_lens, strict=True)) >= block_size:
        tk.cascade_paged_attention(q, kc, vc, meta, 0.1, block_size, num_splits=splits, prefix_splits=splits)
        dev = torch.tensor([block_size], dtype=torch.int32)
        tk.cascade_paged_attention(q, kc, vc, meta, 0.1, dev, num_splits=splits, prefix_splits=splits)


def main() -> None:
    quick = len(sys.argv) > 1 and sys.argv[1] == "quick"
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    # quick keeps head_dim 256: its 64x256 tiles are the ones that spilled at 4 warps.
    head_dims = [128, 256] if quick else [64, 80, 96, 112, 128, 256]
    head_cfgs = [(32, 8)] if quick else [(32, 32), (32, 8), (28, 4), (12, 2), (64, 8), (16, 1), (128, 1)]
    for dtype in dtypes:
        for hd in head_dims:
            for heads, kvh in head_cfgs:
                if dtype != torch.bfloat16 and (heads, kvh) not in ((32, 8),):
                    continue
                if hd not in (64, 128) and (heads, kvh) not in ((32, 8), (28, 4)):
                    continue
                # decode batch of 3, decode batch of 1, mixed batch of 3, single prefill
                case(dtype, heads, kvh, hd, 16, [1, 1, 1], [40, 70, 33], 1)
                case(dtype, heads, kvh, hd, 16, [1, 1, 1], [40, 70, 33], 4)
                case(dtype, heads, kvh, hd, 16, [1], [40], 1)
                case(dtype, heads, kvh, hd, 16, [5, 1, 17], [40, 70, 33], 1)
                case(dtype, heads, kvh, hd, 16, [5, 1, 17], [40, 70, 33], 3)
                case(dtype, heads, kvh, hd, 16, [48], [48], 1)
    for bs in (1, 32, 128):
        case(torch.bfloat16, 32, 8, 128, bs, [1, 1, 1], [40, 70, 33], 2)
        case(torch.bfloat16, 32, 8, 128, bs, [5, 1, 17], [140, 70, 33], 2)
    case(torch.bfloat16, 4, 2, 16, 16, [5, 1, 17], [40, 70, 33], 2)  # tiny test model
    case(torch.float32, 4, 2, 16, 16, [5, 1, 17], [40, 70, 33], 2)
    case(torch.float32, 4, 2, 16, 16, [1, 1, 1], [40, 70, 33], 2)
    fails = [r for r in RESULTS if r[1].startswith("FAIL")]
    # Half-precision variants must not spill registers (local memory is slow and reserved for every thread).
    spills = [r for r in RESULTS if not r[0].split("[", 1)[1].startswith("torch.float32") and " stack=0 " not in r[1]]
    spills = [r for r in spills if r not in fails]
    print(f"\n{len(RESULTS)} compiled, {len(fails)} failed, {len(spills)} half-precision variants spill")
    for name, info in fails + spills:
        print(name, info)
    sys.exit(1 if fails or spills else 0)


if __name__ == "__main__":
    main()
