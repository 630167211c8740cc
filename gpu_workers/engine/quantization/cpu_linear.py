"""Projections whose weights stay quantized on the CPU, multiplied by torch's own CPU kernels.

``CpuInt4Linear``: 4-bit codes packed by ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` and multiplied
by ``_weight_int4pack_mm_for_cpu``. The kernel's weight (checked against a dequantized matmul in the tests) is
``w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` with ``g = k // group_size``, codes ``q`` in 0..15 given
to the packer as int32 ``[N, K]``, and ``scales_and_zeros`` ``[K / group_size, N, 2]`` holding (scale, zero)
in the activations' dtype. It takes group sizes 32, 64, 128 and 256, ``K`` a multiple of the group size and
``N`` a multiple of 16. Any affine 4-bit format maps onto it: ``d * q + m`` is scale ``d``, zero ``m + 8 d``.

``CpuInt8Linear``: int8 ``[N, K]`` with one scale per output channel, ``_weight_int8pack_mm``:
``y = (x @ q^T) * scale`` (any ``N`` and ``K``).

Both kernels accept float32, bfloat16 and float16 activations, but with the scales in the activations' dtype,
and only their bfloat16 path is vectorized: float32 runs a scalar loop, measured 10-20x slower than bfloat16
(and than a float32 ``nn.Linear``) on AVX512. So the layers keep their scales in bfloat16 and run the kernel in
bfloat16 whatever the model's dtype: a float32 model's activations are rounded to bfloat16 on the way in and the
result is widened back.

Past ``DENSE_MIN_ROWS`` rows (a long prefill) the int4 kernel, compute-bound, is slower than unpacking the codes and
running a dense GEMM, so ``CpuInt4Linear`` does that instead: into float32 on AVX2, into bfloat16 where the CPU has
bf16 dot products (``DENSE_DTYPE``; on AVX512 without them the kernel stays: ``DENSE_PATH``). Layers on int8
activations (``cpu_int4_q8.py``) keep their kernel longer: on AVX2 always, with bf16 dot products up to
``INT8_DENSE_MIN_ROWS``. The weight is unpacked
per call into a scratch buffer shared by every layer, so the weights stay 4-bit in memory, and it is the kernel's
own, exactly, before a bfloat16 product rounds it once (a test pins the unpacking against the kernel's float32
path). ``benchmarks/int4_dense_prefill.py`` measured the
crossing point. Reading the packer's layout back is ``cpu_int4_unpack.py``'s job; where that layout is not the one
expected, the kernel multiplies every call.
"""

from __future__ import annotations

import torch
from torch import nn

from . import cpu_int4_q8
from .cpu_int4_unpack import pack_layout, scratch, unpack_codes

KERNEL_DTYPE = torch.bfloat16
INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
INT4_OUT_MULTIPLE = 16  # the packer's tile along N
# Group size of 4-bit weights quantized from float (GGUF Q4_0 / Q4_1 / Q4_K blocks are groups of 32 too).
DEFAULT_INT4_GROUP = 32
# Rows from which an int4 layer multiplies by an unpacked weight instead of calling the kernel: unpacking costs about
# as much as the kernel's 128-row product on the measured AVX2 CPU into float32, and 130-140 rows' on the AVX512_BF16
# one into bfloat16 (benchmarks/int4_dense_prefill.py).
# Only where torch dispatches to AVX-512 at all: under ``ATEN_CPU_CAPABILITY=avx2`` (and oneDNN capped alike) an
# AVX512_BF16 CPU behaves as an AVX2 one, so choosing as on AVX2 keeps such a run what an AVX2 machine would do.
_BF16_DOT = torch.cpu._is_avx512_bf16_supported() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
DENSE_MIN_ROWS = 160 if _BF16_DOT else 128
# The same crossing for layers on int8 activations (the int4 x int8 kernel), None where it never comes: on AVX2 that
# kernel beat the unpacked float32 weight at every size up to 2,048 rows (0.12-0.76x its time), with AVX512_BF16 it
# loses to the unpacked bfloat16 one from about 1,024 (1.08x at 1,024, 1.26x at 2,048; 0.87x at 512).
INT8_DENSE_MIN_ROWS = 768 if _BF16_DOT else None
# The unpacked weight's dtype: bfloat16 where the CPU has bf16 dot products (AVX512_BF16), float32 elsewhere (a
# bfloat16 GEMM without them is several times slower than float32).
DENSE_DTYPE = torch.bfloat16 if _BF16_DOT else torch.float32
# Whether that path is taken at all. With AVX512_BF16 the kernel's own loop is vectorized too: unpacking into float32
# lost to it at every size (0.16-0.58x its time), unpacking into bfloat16 wins from about 130 rows (1.2x at 192
# rows, 1.7-2.0x at 512-1,024; benchmarks/int4_dense_prefill.py, docs/benchmarks.md). On AVX512 without bf16 dot
# products the bfloat16 product is not native and the float32 one was not measured to win: the kernel stays.
DENSE_PATH = _BF16_DOT or not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
# Floats of unpacked weight held at a time (64 MiB): one buffer per thread, reused by every layer; a layer
# larger than this unpacks a piece of its output columns at a time.
_SCRATCH_FLOATS = 16 * 2**20


_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm")


def kernels_problem() -> str | None:
    """Why this torch cannot run the CPU quantized kernels, or None when it can."""
    missing = [op for op in _OPS if not hasattr(torch.ops.aten, op)]
    if missing:
        return f"torch {torch.__version__} has no {', '.join(missing)} (needs torch >= 2.6)"
    return None


def int4_shape_problem(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why a ``[out, in]`` weight cannot take the int4 kernel with this group size, or None."""
    if group_size not in INT4_GROUP_SIZES:
        return f"group size {group_size} is not one of {INT4_GROUP_SIZES}"
    if in_features % group_size:
        return f"in_features={in_features} is not a multiple of the group size {group_size}"
    if out_features % INT4_OUT_MULTIPLE:
        return f"out_features={out_features} is not a multiple of {INT4_OUT_MULTIPLE}"
    return None


def _bias(bias: torch.Tensor | None, out_features: int, dtype: torch.dtype | None, device: object) -> nn.Parameter:
    if bias is not None:
        return nn.Parameter(bias.detach().clone(), requires_grad=False)
    return nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)


def _finish(x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


class CpuInt4Linear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` held as torch's packed CPU int4 codes plus per-group scales and zeros.

    Built empty (the loader fills it with ``set_codes``) or by ``from_codes`` / ``from_float``. Tensors are
    buffers; only the bias is a parameter, in the model's dtype, so the float loader fills it as usual.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group_size: int = DEFAULT_INT4_GROUP,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        problem = int4_shape_problem(out_features, in_features, group_size)
        if problem is not None:
            raise ValueError(f"int4 CPU layer [{out_features}, {in_features}]: {problem}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        # Placeholders until set_codes: the packed layout is the packer's, so it is never allocated empty.
        self.register_buffer("packed", torch.empty(0, dtype=torch.uint8, device=device))
        self.register_buffer("scales_and_zeros", torch.empty(0, dtype=KERNEL_DTYPE, device=device))
        self.bias = _bias(None, out_features, dtype, device) if bias else None
        # The deterministic mode keeps every input on the kernel: a row's sums must not depend on the row count.
        self.batch_invariant = False
        # With int8 activations (``use_int8_activations``): the codes again in the int4 x int8 kernel's form.
        self.register_buffer("q4", None)
        self.register_buffer("q4_d", None)
        self.register_buffer("q4_z", None)
        self.q4_isa = 0

    def extra_repr(self) -> str:
        act = ", int8 activations" if self.int8_activations else ""
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}{act}"

    @property
    def int8_activations(self) -> bool:
        return self.q4 is not None

    def codes(self) -> torch.Tensor:
        """The codes ``[N, K]`` (0..15, uint8) read back from the packed layout (or the int8 kernel's)."""
        if self.q4 is not None:
            return cpu_int4_q8.codes_of(self.q4, 0, self.out_features)
        layout = pack_layout()
        if layout is None:
            raise ValueError("int4 CPU layer: torch's packed layout here is not the expected one; codes unreadable")
        n, k = self.out_features, self.in_features
        codes = torch.empty(n, k, dtype=torch.uint8, device=self.packed.device)
        for start, stop in self._column_pieces():
            into = torch.empty(k, stop - start, device=self.packed.device)
            unpack_codes(self.packed.view(-1), layout, n, k, start, stop, into)
            codes[start:stop] = into.t().to(torch.uint8)
        return codes

    def use_int8_activations(self) -> bool:
        """From now on multiply what torch's int4 kernel would (up to ``INT8_DENSE_MIN_ROWS`` rows, every row under
        the deterministic mode) by the int4 x int8 kernel instead (``cpu_int4_q8.py``: activations quantized per group
        of 32, as llama.cpp does). False, and nothing changes, where it cannot run: a group size other than 32, a
        shape the kernel does not take, no kernel built here."""
        if self.q4 is not None:
            return True
        n = self.out_features
        # K is a multiple of the group size already (int4_shape_problem).
        if self.group_size != cpu_int4_q8.GROUP or n % cpu_int4_q8.ROW_BLOCK:
            return False
        if not cpu_int4_q8.available() or pack_layout() is None:
            return False
        sz = self.scales_and_zeros.float()
        self.q4, self.q4_d, self.q4_z = cpu_int4_q8.pack(self.codes(), sz[..., 0].t(), sz[..., 1].t())
        # Fixed here, a plain int: a compiled step cannot ask torch for its ISA, and it does not change.
        self.q4_isa = cpu_int4_q8.kernel_isa()
        # Nothing reads torch's packed form any more (long prefills unpack the kernel's): one copy of the weights.
        self.packed = self.packed.new_empty(0)
        self.scales_and_zeros = self.scales_and_zeros.new_empty(0)
        return True

    def set_codes(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Fill from codes ``[N, K]`` in 0..15 and ``scale`` / ``zero`` ``[N, K / group]``, standing for
        ``(codes - 8) * scale + zero``; scale and zero are rounded to bfloat16 here."""
        n, k, groups = self.out_features, self.in_features, self.in_features // self.group_size
        if tuple(codes.shape) != (n, k) or tuple(scale.shape) != (n, groups) or tuple(zero.shape) != (n, groups):
            raise ValueError(
                f"int4 CPU layer [{n}, {k}] group {self.group_size}: got codes {tuple(codes.shape)}, "
                f"scale {tuple(scale.shape)}, zero {tuple(zero.shape)}; expected {(n, k)} and {(n, groups)}"
            )
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
            raise ValueError("int4 codes must lie in 0..15")
        device = self.packed.device
        codes = codes.to(device=device, dtype=torch.int32).contiguous()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(device, KERNEL_DTYPE).contiguous()
        if self.q4 is not None:  # on int8 activations already: the kernel's copy of the codes follows them
            self.q4 = self.q4_d = self.q4_z = None
            self.use_int8_activations()

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> CpuInt4Linear:
        """A layer standing for ``(codes - 8) * scale + zero`` (see ``set_codes``)."""
        n, k = codes.shape
        layer = cls(k, n, bias=False, group_size=group_size, device=codes.device)
        layer.set_codes(codes, scale, zero)
        if bias is not None:
            layer.bias = _bias(bias, n, None, None)
        return layer

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = DEFAULT_INT4_GROUP
    ) -> CpuInt4Linear:
        """Quantize a float ``[N, K]`` weight: per group, asymmetric min-max over 16 levels (Q4_1's scheme)."""
        codes, scale, zero = quantize_int4(weight, group_size)
        return cls.from_codes(codes, scale, zero, group_size, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_INT4_GROUP) -> CpuInt4Linear:
        return cls.from_float(linear.weight.data, linear.bias.data if linear.bias is not None else None, group_size)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float ``[N, K]`` weight the kernel multiplies by (run through the kernel's exact float32 path;
        slow, for checks)."""
        if self.q4 is not None:
            into = torch.empty(self.in_features, self.out_features, device=self.q4.device)
            return cpu_int4_q8.weight_t(self.q4, self.q4_d, self.q4_z, 0, self.out_features, into).t().to(dtype)
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self.packed.device)
        sz = self.scales_and_zeros.float()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, sz).t().to(dtype)

    def _column_pieces(self) -> list[tuple[int, int]]:
        """Output columns in pieces whose unpacked weight fits the scratch buffer: whole blocks of the packer's
        layout, and a last partial block on its own (it is packed differently)."""
        layout = pack_layout()
        assert layout is not None
        n, k, block = self.out_features, self.in_features, layout.block_n
        whole = n - n % block
        width = max(block, (_SCRATCH_FLOATS // k) // block * block)
        pieces = [(start, min(start + width, whole)) for start in range(0, whole, width)]
        return pieces + ([(whole, n)] if whole < n else [])

    def _unpack(self, start: int, stop: int, into: torch.Tensor) -> torch.Tensor:
        """Columns ``start:stop`` of the kernel's weight transposed, ``(q - 8) * scale + zero`` in float32,
        written into ``into`` (``[K, stop - start]``, contiguous); each group's scale and zero broadcast along its
        rows."""
        if self.q4 is not None:
            return cpu_int4_q8.weight_t(self.q4, self.q4_d, self.q4_z, start, stop, into)
        layout = pack_layout()
        assert layout is not None
        k, g, width = self.in_features, self.group_size, stop - start
        unpack_codes(self.packed.view(-1), layout, self.out_features, k, start, stop, into)
        sz = self.scales_and_zeros[:, start:stop].float().unsqueeze(1)
        # (q - 8) * s + z, fused as the kernel's float32 path computes it (bit for bit: the tests compare).
        codes = into.view(k // g, g, width).sub_(8)
        torch.addcmul(sz[..., 1], codes, sz[..., 0], out=codes)
        return into

    def dense_weight_t(self) -> torch.Tensor:
        """The kernel's weight transposed, float32 ``[K, N]``, unpacked from the packed codes (a new tensor)."""
        pieces = [
            self._unpack(a, b, torch.empty(self.in_features, b - a, device=self.packed.device))
            for a, b in self._column_pieces()
        ]
        return torch.cat(pieces, dim=1)

    def _dense_mm(self, flat: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``flat @ W^T`` through the unpacked weight in ``dtype`` (``DENSE_DTYPE`` by default: float32, or
        bfloat16 where the CPU multiplies it natively), a piece of columns at a time in the scratch buffers (a fresh
        ``[K, N]`` tensor per call costs page faults that more than double the unpacking). The weight is unpacked in
        float32, exactly the kernel's, and rounded to bfloat16 once for a bfloat16 product."""
        dtype = DENSE_DTYPE if dtype is None else dtype
        x = flat.to(dtype)
        k = self.in_features

        def unpacked(start: int, stop: int) -> torch.Tensor:
            weight = self._unpack(start, stop, scratch(k * (stop - start)).view(k, -1))
            if dtype == torch.float32:
                return weight
            return scratch(k * (stop - start), dtype).view(k, -1).copy_(weight)

        pieces = self._column_pieces()
        if len(pieces) == 1:  # the common case: no copy into a separate output
            return torch.mm(x, unpacked(*pieces[0]))
        out = torch.empty(x.shape[0], self.out_features, device=x.device, dtype=dtype)
        for start, stop in pieces:
            out[:, start:stop] = torch.mm(x, unpacked(start, stop))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        dense_from = DENSE_MIN_ROWS if self.q4 is None else INT8_DENSE_MIN_ROWS
        dense = DENSE_PATH and not self.batch_invariant and dense_from is not None and flat.shape[0] >= dense_from
        if dense and flat.device.type == "cpu" and pack_layout() is not None:
            out = self._dense_mm(flat)
        elif self.q4 is not None:
            out = cpu_int4_q8.mm(flat, self.q4, self.q4_d, self.q4_z, self.q4_isa)
        else:
            flat = flat.to(KERNEL_DTYPE).contiguous()
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        return _finish(x, out, self.bias, self.out_features)


def use_int8_activations(model: nn.Module) -> int:
    """Put every ``CpuInt4Linear`` of ``model`` that the int4 x int8 kernel takes on it; returns how many."""
    return sum(1 for module in model.modules() if isinstance(module, CpuInt4Linear) and module.use_int8_activations())


class CpuInt8Linear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` held as int8 ``[N, K]`` and one bfloat16 scale per output channel."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", torch.empty(0, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(0, dtype=KERNEL_DTYPE, device=device))
        self.bias = _bias(None, out_features, dtype, device) if bias else None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"

    def set_float(self, weight: torch.Tensor) -> None:
        """Fill from a float ``[N, K]`` weight: symmetric, per output channel (absmax / 127)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"int8 CPU layer [{self.out_features}, {self.in_features}]: got weight {tuple(weight.shape)}"
            )
        qweight, scales = quantize_int8(weight)
        self.qweight = qweight.to(self.qweight.device)
        self.scales = scales.to(self.scales.device)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> CpuInt8Linear:
        layer = cls(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
        layer.set_float(weight)
        if bias is not None:
            layer.bias = _bias(bias, weight.shape[0], None, None)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> CpuInt8Linear:
        return cls.from_float(linear.weight.data, linear.bias.data if linear.bias is not None else None)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float ``[N, K]`` weight the kernel multiplies by."""
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        return _finish(x, out, self.bias, self.out_features)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float ``[N, K]`` -> (codes int32 ``[N, K]`` in 0..15, scale, zero ``[N, K / group]``) with
    ``w ~ (codes - 8) * scale + zero``: each group's min and max span the 16 levels. Scale and zero are
    rounded to bfloat16 first and the codes rounded against them, so storing them loses nothing more."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of the group size {group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).to(KERNEL_DTYPE).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0
    zero = (lo + 8 * scale).to(KERNEL_DTYPE).float()
    codes = torch.round((w - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + 8).clamp_(0, 15)
    return codes.to(torch.int32).reshape(n, k), scale, zero


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``[N, K]`` -> (int8 ``[N, K]``, bfloat16 scales ``[N]``): symmetric per output channel, the codes
    rounded against the bfloat16 scale actually stored."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).to(KERNEL_DTYPE).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale[:, None]).clamp_(-128, 127).to(torch.int8)
    return codes.contiguous(), scale.to(KERNEL_DTYPE)
