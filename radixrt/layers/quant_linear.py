"""Weight-only quantized linear modules on PyTorch's CPU kernels.

Every module computes ``y = x @ W.T (+ bias)`` for ``x`` of shape ``[..., in]`` and returns the
activation dtype; ``reference_weight()`` returns the float32 ``[out, in]`` weight that the kernel
effectively multiplies by (the dequantized weight), so a plain fp32 matmul against it is an oracle.

Kernels and their measured semantics (torch 2.13 CPU build):

* ``torch._weight_int8pack_mm(x [T, K], w int8 [N, K], scales [N])`` computes
  ``x @ (w * scales[:, None]).T`` with fp32 accumulation, output rounded once to ``x.dtype``.
  ``scales`` must have exactly ``x.dtype``; ``x`` must be 2-D and contiguous.
* ``torch._convert_weight_to_int4pack_for_cpu(q int32 [N, K] in 0..15, inner_k_tiles)`` packs to
  uint8 ``[N, K/2]`` in a CPU-capability dependent layout (AVX512 / AVX2 / NEON differ, so the packed
  tensor is not portable between machines); ``N`` must be a multiple of 16; ``inner_k_tiles`` is unused.
* ``torch._weight_int4pack_mm_for_cpu(x [T, K], packed, group, scales_and_zeros [K/group, N, 2])``
  dequantizes ``w = fma(q - 8, scale, zero)`` in fp32 per group of ``group`` consecutive input
  columns (``group`` in {32, 64, 128, 256}), accumulates in fp32 and rounds once to ``x.dtype``;
  ``scales_and_zeros`` must have exactly ``x.dtype``.

Only the bfloat16 paths are vectorised on x86: fp32 (and fp16) activations run a scalar reference
loop that is 10-70x slower than bf16 (see ``compute_dtype``). The bf16 int8 kernel also reads out of
bounds (segfaults) when ``K % 16 != 0``, so :class:`Int8Linear` pads ``K`` in that case.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.layers.quant_math import (
    quantize_int4_groupwise,
    quantize_int8_per_channel,
    quantize_int8_symmetric,
    w8a8_linear,
)

#: Activation dtypes the CPU kernels accept (bf16 is the only vectorised one on x86).
KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
#: Group sizes ``_weight_int4pack_mm_for_cpu`` accepts.
INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu requires N % 16 == 0
_INT8_K_MULTIPLE = 16  # the bf16 int8 kernel has no K tail handling


def _check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"unsupported activation/compute dtype {dtype}; supported: {list(KERNEL_DTYPES)}")
    return dtype


class QuantLinearBase(nn.Module):
    """Common state of the quantized linears: shapes, optional bias and the compute dtype.

    ``compute_dtype`` None means "compute in the activation dtype". Setting it (e.g. bf16 under an fp32
    model) casts ``x`` to it for the kernel and the result back to ``x.dtype``. Scale buffers are stored
    in ``compute_dtype`` (float32 when None); a differently typed call uses a cached cast of them.
    """

    bias: torch.Tensor | None
    dense_weight: torch.Tensor | None
    dense_int8: (
        torch.Tensor | None
    )  # [in, out] view of an int8 [out, in] weight (keep_dense_weight(int8=True))
    dense_int8_scale: torch.Tensor | None  # float32 [out]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("dense_weight", None, persistent=False)  # see keep_dense_weight
        self.register_buffer("dense_int8", None, persistent=False)
        self.register_buffer("dense_int8_scale", None, persistent=False)
        self.dense_min_tokens = 0
        self.compute_dtype = None if compute_dtype is None else _check_dtype(compute_dtype)
        self.storage_dtype = compute_dtype or torch.float32
        if bias is not None:
            if bias.shape != (out_features,):
                raise ValueError(f"bias shape {tuple(bias.shape)} != ({out_features},)")
            self.register_buffer("bias", bias.detach().to(self.storage_dtype).clone())
        else:
            self.bias = None
        self._casts: dict[tuple[str, torch.dtype], tuple[int, int, torch.Tensor]] = {}

    def _as(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t`` in ``dtype``; casts are cached and invalidated when the source tensor changes."""
        if t.dtype == dtype:
            return t
        key = (name, dtype)
        hit = self._casts.get(key)
        if hit is not None and hit[0] == t.data_ptr() and hit[1] == t._version:
            return hit[2]
        cast = t.to(dtype).contiguous()
        self._casts[key] = (t.data_ptr(), t._version, cast)
        return cast

    def _default_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        return _check_dtype(dtype or self.compute_dtype or self.storage_dtype)

    def keep_dense_weight(self, min_tokens: int, int8: bool = False) -> int:
        """Also keep the dequantized weight and multiply batches of ``>= min_tokens`` rows by it (``F.linear``,
        oneDNN's dense GEMM) instead of the weight-only kernel; returns the bytes kept.

        The weight-only kernels reach ~300 GFLOP/s at any batch (they dequantize every tile again for each
        block of rows), a bf16 GEMM ~800 at a few hundred rows: prefill and extend run dense, decode keeps
        the kernel (which reads 4x fewer bytes). The kept weight is ``reference_weight()`` rounded once to
        the storage dtype: in float32 the very weight the kernel multiplies by; in bf16 within 2^-9
        (relative) of it per element (the kernel dequantizes to fp32 inside).

        ``int8``: keep the reference weight requantized to int8 per output row (symmetric, absmax / 127)
        instead, and multiply those batches by it with int8 activations (:func:`w8a8_linear`): 1 byte a
        weight, ~1.7x a bf16 GEMM's throughput on VNNI, both operands rounded.
        """
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.dense_min_tokens = min_tokens
        if int8:
            w8, scale = quantize_int8_symmetric(self.reference_weight())
            self.dense_int8, self.dense_int8_scale = w8.T, scale
            return w8.numel() + scale.numel() * 4
        w = self.reference_weight().to(self.storage_dtype).contiguous()
        self.dense_weight = w
        return w.numel() * w.element_size()

    def _matmul(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]`` in ``x.dtype``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected last dim {self.in_features}, got input shape {tuple(x.shape)}")
        cdt = self.compute_dtype or x.dtype
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != cdt:
            x2 = x2.to(_check_dtype(cdt))
        if self.dense_weight is not None and x2.shape[0] >= self.dense_min_tokens:
            y = F.linear(x2, self._as("dense_weight", self.dense_weight, cdt))
        elif (
            self.dense_int8 is not None
            and self.dense_int8_scale is not None
            and x2.shape[0] >= self.dense_min_tokens
        ):
            y = w8a8_linear(x2, self.dense_int8, self.dense_int8_scale)
        else:
            y = self._matmul(x2.contiguous(), cdt)
        if self.bias is not None:
            y = y + self._as("bias", self.bias, cdt)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def reference_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the kernel multiplies by when computing in ``dtype``.

        ``dtype`` defaults to ``compute_dtype`` (or the storage dtype): scales are cast to the activation
        dtype for the kernel, so GGUF-derived fp16 scales are only exact for fp32 computation.
        """
        raise NotImplementedError

    def reference_bias(self, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The bias as added when computing in ``dtype`` (float32), or None."""
        if self.bias is None:
            return None
        return self.bias.to(self._default_dtype(dtype)).float()

    def extra_repr(self) -> str:
        cdt = "activation" if self.compute_dtype is None else str(self.compute_dtype)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, compute_dtype={cdt}"
        )


class DenseLinear(QuantLinearBase):
    """An unquantized weight (``F.linear``), for GGUF F32/F16/BF16 tensors.

    The weight is stored in ``compute_dtype`` (float32 when None) and cast (cached) for other dtypes.
    """

    weight: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None
    ) -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        super().__init__(weight.shape[1], weight.shape[0], bias, compute_dtype)
        self.register_buffer("weight", weight.detach().to(self.storage_dtype).contiguous().clone())

    def _matmul(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.linear(x2, self._as("weight", self.weight, dtype))

    def reference_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """See :meth:`QuantLinearBase.reference_weight`."""
        return self.weight.to(self._default_dtype(dtype)).float()


class Int8Linear(QuantLinearBase):
    """Int8 weight-only linear: ``W = qweight * scales[:, None]`` (symmetric, per output channel).

    Runs ``torch._weight_int8pack_mm``. ``qweight`` is int8 ``[out, in]``, ``scales`` ``[out]``.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    u8_codes: torch.Tensor | None  # radixrt's float32 kernel layout (use_radixrt_kernel), else None
    u8_sz: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be int8 [out, in], got {qweight.dtype} {tuple(qweight.shape)}")
        out_f, in_f = qweight.shape
        if scales.shape != (out_f,):
            raise ValueError(f"scales shape {tuple(scales.shape)} != ({out_f},)")
        super().__init__(in_f, out_f, bias, compute_dtype)
        self.k_pad = (-in_f) % _INT8_K_MULTIPLE
        qw = F.pad(qweight, (0, self.k_pad)) if self.k_pad else qweight
        self.register_buffer("qweight", qw.detach().contiguous().clone())
        self.register_buffer("scales", scales.detach().to(self.storage_dtype).contiguous().clone())
        self.register_buffer("u8_codes", None, persistent=False)
        self.register_buffer("u8_sz", None, persistent=False)
        self.u8_group = 0

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None
    ) -> Int8Linear:
        """Symmetric per-output-channel int8: ``scale = absmax / 127`` rounded to bf16, ``q = round(w / scale)``.

        Scales lie on the bf16 grid, so the effective weight is identical for fp32 and bf16 activations.
        """
        qweight, scales = quantize_int8_per_channel(weight)
        return cls(qweight, scales, bias, compute_dtype)

    def use_radixrt_kernel(self, dtype: torch.dtype) -> int:
        """Also keep the weight as 8-bit codes ``u = q + 128`` in the layout of radixrt's float32 kernel
        (``radixrt_int4_f32::mm_u8``, with ``w = (u - 136) * s + 8 s``, every group of a row sharing the row's
        scale) and multiply float32 batches by it instead of torch's ``_weight_int8pack_mm``, a scalar loop
        for float32 activations; returns the bytes kept. bf16 keeps torch's (vectorised) kernel."""
        from radixrt.kernels.int4_gemm import pack_u8

        if dtype != torch.float32:
            raise ValueError(f"radixrt's kernel for int8 linears computes in float32, not {dtype}")
        _require_kernel(dtype)
        k = self.qweight.shape[1]
        group = next(g for g in (256, 128, 64, 32, 16) if k % g == 0)  # k is a multiple of 16
        s = self.scales.float()[:, None].expand(-1, k // group)
        w8 = pack_u8(self.qweight.to(torch.int32) + 128, s, 8 * s, group)
        self.register_buffer("u8_codes", w8.codes, persistent=False)
        self.register_buffer("u8_sz", w8.sz, persistent=False)
        self.u8_group = group
        return w8.nbytes()

    def _matmul(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.k_pad:
            x2 = F.pad(x2, (0, self.k_pad))
        if dtype == torch.float32 and self.u8_codes is not None:
            y = torch.ops.radixrt_int4_f32.mm_u8(x2.contiguous(), self.u8_codes, self.u8_sz, self.u8_group)
            return y if y.shape[1] == self.out_features else y[:, : self.out_features].contiguous()
        return torch._weight_int8pack_mm(x2, self.qweight, self._as("scales", self.scales, dtype))

    def reference_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """See :meth:`QuantLinearBase.reference_weight`."""
        s = self.scales.to(self._default_dtype(dtype)).float()
        return self.qweight[:, : self.in_features].float() * s[:, None]


class Int4Linear(QuantLinearBase):
    """Group-wise asymmetric 4-bit linear on ``torch._weight_int4pack_mm_for_cpu``, as a sum of planes.

    Plane ``p`` holds codes ``q_p`` in 0..15 with one scale and zero per ``group_size`` input columns:
    ``W = sum_p fma(q_p - 8, scale_p, zero_p)``. One plane is ordinary int4; two planes (high and low
    nibble of an up-to-8-bit code) represent GGUF's 5- and 8-bit block formats exactly.

    Args:
        codes: uint8/int ``[P, out, in]`` (or ``[out, in]`` for one plane), values in 0..15.
        scales, zeros: ``[P, out, in / group_size]`` (or ``[out, in / group_size]``).
        group_size: one of :data:`INT4_GROUP_SIZES`; ``in`` must be a multiple of it.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    i4_codes: torch.Tensor | None  # radixrt's kernel layout (use_radixrt_kernel), else None
    i4_sz: torch.Tensor | None
    u8_codes: torch.Tensor | None  # two planes as one 8-bit code (use_radixrt_kernel), else None
    u8_sz: torch.Tensor | None

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        if codes.dim() == 2:
            codes, scales, zeros = codes[None], scales[None], zeros[None]
        if codes.dim() != 3:
            raise ValueError(f"codes must be [P, out, in] or [out, in], got shape {tuple(codes.shape)}")
        n_planes, out_f, in_f = codes.shape
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"unsupported int4 group size {group_size}; supported: {list(INT4_GROUP_SIZES)}")
        if in_f % group_size:
            raise ValueError(f"in_features {in_f} is not a multiple of the int4 group size {group_size}")
        n_groups = in_f // group_size
        if scales.shape != (n_planes, out_f, n_groups) or zeros.shape != scales.shape:
            raise ValueError(
                f"scales/zeros shapes {tuple(scales.shape)}/{tuple(zeros.shape)} != {(n_planes, out_f, n_groups)}"
            )
        super().__init__(in_f, out_f, bias, compute_dtype)
        self.group_size = group_size
        self.n_planes = n_planes
        n_pad = (-out_f) % _INT4_N_MULTIPLE
        self.padded_out = out_f + n_pad
        # Padding rows: code 8, scale 0, zero 0 -> zero weight; the output is sliced back to out_f.
        codes_i32 = F.pad(codes.to(torch.int32), (0, 0, 0, n_pad), value=8)
        packed = torch.stack(
            [torch._convert_weight_to_int4pack_for_cpu(c.contiguous(), 2) for c in codes_i32]
        )
        sz = torch.stack(
            [F.pad(scales.float(), (0, 0, 0, n_pad)), F.pad(zeros.float(), (0, 0, 0, n_pad))], -1
        )
        self.register_buffer("packed", packed)  # [P, N_pad, in / 2] uint8, CPU-layout specific
        # [P, in / group, N_pad, 2] as the kernel wants it
        self.register_buffer("scales_and_zeros", sz.transpose(1, 2).to(self.storage_dtype).contiguous())
        for name in ("i4_codes", "i4_sz", "u8_codes", "u8_sz"):
            self.register_buffer(name, None, persistent=False)
        self.kernel_dtype: torch.dtype | None = None  # the activation dtype radixrt's kernel layout is for
        self.act_int8 = False  # float32: int8 activations against the codes (``radixrt_int4_f32::mm_q8``)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        group_size: int = 32,
        compute_dtype: torch.dtype | None = None,
    ) -> Int4Linear:
        """Asymmetric 4-bit per group of ``group_size`` inputs (min/max range, scale and zero on the bf16 grid)."""
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"unsupported int4 group size {group_size}; supported: {list(INT4_GROUP_SIZES)}")
        codes, scales, zeros = quantize_int4_groupwise(weight, group_size)
        return cls(codes, scales, zeros, group_size, bias, compute_dtype)

    def use_radixrt_kernel(self, dtype: torch.dtype, act_int8: bool = False) -> int:
        """Also keep the weights in the layout of radixrt's int4 kernels (:mod:`radixrt.kernels.int4_gemm`:
        AVX512-BF16 for bf16, AVX2 for float32) and multiply ``dtype`` batches by them instead of torch's
        ``_weight_int4pack_mm_for_cpu``; returns the bytes kept. The scales are those torch's kernel uses in
        ``dtype``, so both multiply by the same weight. ``act_int8`` (float32, one plane or two summed): the
        activations are rounded to int8 per group at run time and multiply the codes in integers
        (``radixrt_int4_f32::mm_q8``, ``--int4-kernel q8``: faster, not exact).

        Two planes whose high scale is 16 times the low one in every group (GGUF's Q8_0 and Q5 blocks) are
        kept as one 8-bit code ``16 hi + lo`` (``radixrt_int4::mm_u8``): one product per weight instead of
        one per plane, for the same bytes."""
        from radixrt.kernels.int4_gemm import pack, pack_u8

        _require_kernel(dtype)
        sz = self.scales_and_zeros.to(dtype).float()[:, :, : self.out_features]  # [P, K/G, N, 2]
        scales, zeros = sz[..., 0].transpose(1, 2), sz[..., 1].transpose(1, 2)  # [P, N, K/G]
        codes = self.codes()
        if self.n_planes == 2 and torch.equal(scales[0], 16 * scales[1]):
            # (hi - 8) 16 s + z_hi + (lo - 8) s + z_lo = (16 hi + lo - 136) s + (z_hi + z_lo)
            u = codes[0].to(torch.int32) * 16 + codes[1].to(torch.int32)
            w8 = pack_u8(u, scales[1], zeros[0] + zeros[1], self.group_size, dtype)
            self.register_buffer("u8_codes", w8.codes, persistent=False)
            self.register_buffer("u8_sz", w8.sz, persistent=False)
            self.kernel_dtype = dtype
            return w8.nbytes()
        w = pack(codes, scales, zeros, self.group_size, dtype)
        self.register_buffer("i4_codes", w.codes, persistent=False)
        self.register_buffer("i4_sz", w.sz, persistent=False)
        self.kernel_dtype = dtype
        self.act_int8 = act_int8 and dtype == torch.float32
        return w.nbytes()

    def _matmul(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.kernel_dtype == dtype and (self.i4_codes is not None or self.u8_codes is not None):
            ops = torch.ops.radixrt_int4 if dtype == torch.bfloat16 else torch.ops.radixrt_int4_f32
            if self.u8_codes is not None:
                y = ops.mm_u8(x2, self.u8_codes, self.u8_sz, self.group_size)
            elif self.act_int8:
                y = ops.mm_q8(x2, self.i4_codes, self.i4_sz, self.group_size)
            else:
                y = ops.mm(x2, self.i4_codes, self.i4_sz, self.group_size)
            return y if y.shape[1] == self.out_features else y[:, : self.out_features].contiguous()
        sz = self._as("scales_and_zeros", self.scales_and_zeros, dtype)
        y = torch._weight_int4pack_mm_for_cpu(x2, self.packed[0], self.group_size, sz[0])
        for p in range(1, self.n_planes):
            y = y + torch._weight_int4pack_mm_for_cpu(x2, self.packed[p], self.group_size, sz[p])
        if self.padded_out != self.out_features:
            y = y[:, : self.out_features].contiguous()
        return y

    def codes(self) -> torch.Tensor:
        """The uint8 codes ``[P, out, in]``, read back through the kernel (the packed layout is CPU-specific).

        Multiplies the identity by each plane with scale 1 and zero 8, so the output is exactly ``q``.
        """
        k, n = self.in_features, self.padded_out
        unit = torch.stack(
            [torch.ones(k // self.group_size, n), torch.full((k // self.group_size, n), 8.0)], -1
        ).to(torch.bfloat16)
        planes = []
        for p in range(self.n_planes):
            cols = []
            for start in range(0, k, 512):
                eye = torch.eye(k, dtype=torch.bfloat16)[start : start + 512]
                cols.append(torch._weight_int4pack_mm_for_cpu(eye, self.packed[p], self.group_size, unit))
            planes.append(torch.cat(cols).T[: self.out_features].to(torch.uint8))
        return torch.stack(planes)

    def reference_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """See :meth:`QuantLinearBase.reference_weight`."""
        sz = self.scales_and_zeros.to(self._default_dtype(dtype)).double()[:, :, : self.out_features]
        out_f, groups = self.out_features, self.in_features // self.group_size
        planes = []
        for p, codes in enumerate(self.codes()):
            # the kernel's fp32 fma(q - 8, s, z): q * s is exact in float64, the sum is rounded to fp32;
            # scale and zero broadcast over each group of columns
            q = codes.view(out_f, groups, self.group_size).double() - 8.0
            s, z = (sz[p, :, :, i].T.contiguous()[..., None] for i in (0, 1))
            planes.append(torch.addcmul(z, q, s).float().reshape(out_f, self.in_features))
        if len(planes) == 1:
            return planes[0]
        return torch.stack(planes).double().sum(0).float()  # planes summed exactly, rounded once

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}, planes={self.n_planes}"


def _require_kernel(dtype: torch.dtype) -> None:
    """Load radixrt's kernel for ``dtype`` activations; ``ValueError`` saying why it cannot run here."""
    from radixrt.kernels import int4_gemm

    reason = int4_gemm.unavailable_reason(dtype)  # ValueError for a dtype it has no kernel for
    if reason is not None:
        raise ValueError(f"radixrt's {dtype} int4 kernel cannot run here: {reason}")
