"""The CPU attention backend: one batched SDPA call per layer over gathered K/V (the reference), and C
kernels that read the paged KV pool in place: decode (`radixrt.kernels.cpu_decode`) and extend
(`radixrt.kernels.cpu_extend`, flash attention over the cached prefix and the new tokens).

Per forward it masks the metadata's padded ``[B, max_seq_len]`` slot table and builds a boolean mask
(causal over prefix + new tokens, sequence length, optional sliding window); per layer it gathers K/V
through that table and runs ``scaled_dot_product_attention`` with GQA. Decode steps (one new token per
request, or up to ``SMALL_EXTEND`` new tokens as one decode query each) call the C decode kernel instead, and
longer extends the C extend kernel (no slot table, mask or gather is built for them) where it is the faster
path on this CPU (`extend_kernel_max_tokens`). Extends the C kernel does not take run request by request
(`_apart`, a Python loop over the batch's requests): each attends its cached prefix and its own new tokens
apart (`cpu_cascade.extend_over_prefix`: no mask tensor, the query heads of a kv head stacked into one GEMM,
a prefix that is one run of slots read in place), a request with nothing cached its own K/V with SDPA's causal
mask. All of it when the C library could be built here (gcc); when it cannot, the backend logs why once and
runs the reference path.

A speculative verify (``TARGET_VERIFY``: a few new tokens per request) has two kernels (``verify_kernels``):
one C decode query per token ("decode"), which reads a request's K/V once per token, or the reference path
("sdpa"), which gathers it once for all its tokens and multiplies them in one GEMM. The model runner times
both at warm-up and keeps the faster: on a 2-core AVX2 CPU (the C kernels are written for AVX-512) at a
1k-token context "sdpa" takes ~0.4x "decode"'s time per query.

Float8 KV (``--kv-cache-dtype fp8_e5m2|fp8_e4m3``): the C kernels read the float8 codes in place and widen
them in registers, with the pool's scales (``kv_scales``: per-channel K, per-head V, e4m3 only) folded into
the query and the output. On the reference path gathered K/V are widened to the query's dtype and multiplied
by the scales before SDPA.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from radixrt.kernels import cpu_cascade, cpu_decode, cpu_extend
from radixrt.kernels.base import AttentionBackend, AttentionMetadata, ForwardMode, KVStore, NativeStep
from radixrt.kernels.fp8 import dequantize_fp8

logger = logging.getLogger(__name__)

# Which path runs extends longer than SMALL_EXTEND: "c" (the C extend kernel), "sdpa" (gather + SDPA) or
# "auto" (the default), by the CPU (docs/cpu.md, measured on the embedded model's attention, 2 threads):
# - AVX-512 without AMX: "c". On a Zen 4 the kernel ran 256 new tokens over a 3k cached prefix 8x faster than
#   gather + SDPA per layer.
# - AVX-512 with AMX (Sapphire Rapids and later): "c" up to AMX_C_EXTEND_MAX new tokens per request, longer
#   ones "sdpa": torch's SDPA multiplies on AMX tiles there, which outruns the kernel's AVX512-BF16 dot
#   products once the tokens amortize its K/V gather (per layer over a 3k prefix: 17 tokens 0.57x the
#   time of gather + SDPA, 32 0.84x, 64 1.35x, 256 1.84x). That holds for batches of several requests; a
#   single request's extend takes the split path at any length (`init_forward_metadata`: no gather there).
# - AVX2: "c", since its register blocks were sized for 16 ymm registers and its float32 path reads K / V in
#   place (before that it ran 8-12x below SDPA there). Float32, 2 threads, per layer, alternated runs: 256 new
#   tokens over a 3k prefix took 0.74-0.85x the time of the SDPA split path (`cpu_cascade.extend_over_prefix`),
#   a 512-token prefill 0.64-0.65x, 100 over 1k 0.58x, 32 over 3k 0.38-0.50x.
# - Other CPUs (no AVX2): "sdpa" (the kernel is unmeasured there).
EXTEND_KERNEL_ENV = "RADIXRT_CPU_EXTEND_KERNEL"
AMX_C_EXTEND_MAX = 48
C_EXTEND_ALWAYS = 1 << 62  # an extend_kernel_max_tokens() with no limit


def extend_kernel_max_tokens() -> int:
    """The longest extend (new tokens of one request) the C extend kernel takes by default, by
    `EXTEND_KERNEL_ENV` and the CPU: 0 (never: gather + SDPA), `AMX_C_EXTEND_MAX` or `C_EXTEND_ALWAYS`.
    ValueError naming the variable for a bad value."""
    choice = os.environ.get(EXTEND_KERNEL_ENV, "auto").lower()
    if choice not in ("auto", "c", "sdpa"):
        raise ValueError(f"{EXTEND_KERNEL_ENV}: must be auto, c or sdpa, got {choice!r}")
    if choice != "auto":
        return C_EXTEND_ALWAYS if choice == "c" else 0
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512") and capability != "AVX2":
        return 0
    return AMX_C_EXTEND_MAX if torch.cpu._is_amx_tile_supported() else C_EXTEND_ALWAYS


@runtime_checkable
class ScaledKVStore(Protocol):
    """A KV store whose stored values need per-head scales to dequantize (float8 pools)."""

    def kv_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...


@runtime_checkable
class PlainKVStore(Protocol):
    """A KV store whose ``set_kv`` is a plain row copy into per-layer buffers (`KVPool.plain_buffers`)."""

    def plain_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None: ...


# Extends of at most this many tokens per request run as one decode query per token through the C decode
# kernel; longer ones through the C extend kernel.
SMALL_EXTEND = 16


class TorchNativeBackend(AttentionBackend):
    """Reference backend; every other backend is tested against it. ``use_decode_kernel`` False forces the
    reference path for every forward; ``use_extend_kernel`` False keeps the C decode kernel but runs extends
    longer than ``SMALL_EXTEND`` through the reference path. None (the default) takes the C extend kernel for
    extends of up to `extend_kernel_max_tokens` new tokens per request, True for every extend; the attribute
    ``extend_kernel_max`` holds that limit."""

    def __init__(
        self,
        kv: KVStore,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        use_decode_kernel: bool = True,
        use_extend_kernel: bool | None = None,
    ) -> None:
        super().__init__(kv, num_heads, num_kv_heads, head_dim, scale, sliding_window)
        self.kv_fp8 = kv.get_kv_buffer(0)[0].dtype in (torch.float8_e5m2, torch.float8_e4m3fn)
        self.scaled_kv = kv if isinstance(kv, ScaledKVStore) else None
        self.use_decode_kernel = use_decode_kernel and cpu_decode.available()
        if use_decode_kernel and not self.use_decode_kernel:
            logger.warning(
                "the C attention kernels are unavailable (%s): decode and extend gather K/V per layer "
                "instead (several times slower at long contexts)",
                cpu_decode.unavailable_reason(),
            )
        self.extend_kernel_max = extend_kernel_max_tokens() if use_extend_kernel is None else C_EXTEND_ALWAYS
        wanted = self.extend_kernel_max > 0 if use_extend_kernel is None else use_extend_kernel
        self.use_extend_kernel = wanted and self.use_decode_kernel
        # Decode batches whose requests share a prefix of pool slots attend it once for all (cpu_cascade).
        self.cascade_min = (
            cpu_cascade.cascade_min_positions() if not self.kv_fp8 and sliding_window is None else 0
        )
        # A speculative verify's short extends: one C decode query per token ("decode") or gather + SDPA over
        # each request's K/V once for all its new tokens ("sdpa"); the model runner times both at warm-up.
        self.verify_kernel = "decode"

    def verify_kernels(self) -> list[str]:
        return ["decode", "sdpa"] if self.use_decode_kernel else []

    def use_verify_kernel(self, name: str) -> None:
        if name not in self.verify_kernels():
            raise ValueError(f"verify kernel: {name!r} is not one of {self.verify_kernels()}")
        self.verify_kernel = name

    def native_decode_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        if not self.use_decode_kernel or self.kv_fp8 or not isinstance(self.kv, PlainKVStore):
            return None
        return self.kv.plain_buffers()

    def native_decode_step(self) -> NativeStep | None:
        if self._token_table is None or self._split is not None or self._extend_kernel:
            return None
        c = self._cascade
        if c is not None:
            return c.suffix_table, c.suffix_lens, c
        return self._token_table, self._token_lens, None

    _slot_table: torch.Tensor
    _q_index: torch.Tensor
    _q_valid: torch.Tensor
    _mask: torch.Tensor | None
    _additive: torch.Tensor | None
    _causal: bool

    def init_forward_metadata(self, md: AttentionMetadata) -> None:
        # The C decode kernel's slot table and lengths (None: another path): for a decode batch md's own,
        # for a short extend one row per new token (below).
        self._token_table: torch.Tensor | None = None
        self._split: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cascade: cpu_cascade.SharedPrefix | None = None
        # Per request (new tokens start, end, cached prefix's slots or None): attended apart (`_apart`).
        self._requests: list[tuple[int, int, torch.Tensor | slice | None]] | None = None
        self._causal = False  # set by `_plan_reference` for one request's plain prefill
        # Extends of single requests: each attends its cached prefix and its own tokens apart (`_requests`).
        apart = (
            self.use_decode_kernel
            and not self.kv_fp8
            and self.sliding_window is None
            and md.mode == ForwardMode.EXTEND
            and md.max_extend_len > SMALL_EXTEND
            # Several requests: where the C kernel would not take them (AMX past AMX_C_EXTEND_MAX, AVX2), in
            # place of one padded, masked SDPA (1.0-1.08x faster on ReAct-shaped batches; up to 48 tokens over
            # a 335-token prefix, six requests ran 0.86x the C kernel's speed apart).
            and (md.batch_size == 1 or md.max_extend_len > self.extend_kernel_max)
        )
        self._extend_kernel = (
            self.use_extend_kernel
            and SMALL_EXTEND < md.max_extend_len <= self.extend_kernel_max
            # With AMX an extend runs faster request by request (prefix, then its own tokens; SDPA on the tiles)
            # at any length: over a 360-3k prefix 17-48 tokens took 0.64-1.0x the C kernel's time.
            and not (apart and self.extend_kernel_max < C_EXTEND_ALWAYS)
        )
        if self._extend_kernel:
            return  # the C kernel reads md's slot table, qo_indptr and seq_lens as they are
        if self.use_decode_kernel and md.max_extend_len == 1 and int(md.qo_indptr[-1]) == md.batch_size:
            self._token_table, self._token_lens = md.slot_table, md.seq_lens  # no mask or gather tables
            if self.cascade_min:
                self._cascade = cpu_cascade.plan_shared_prefix(md.slot_table, md.seq_lens, self.cascade_min)
            return
        short = self.use_decode_kernel and 1 < md.max_extend_len <= SMALL_EXTEND
        extend_lens = md.qo_indptr[1:] - md.qo_indptr[:-1]
        if short and md.mode == ForwardMode.TARGET_VERIFY and self.verify_kernel == "sdpa":
            # A verify: its single-token requests (plain rows) through the C decode kernel, the drafted ones
            # through gather + SDPA, each request's K/V gathered once for all its new tokens.
            multi = extend_lens > 1
            tok_multi = torch.repeat_interleave(multi, extend_lens)
            self._split = (torch.nonzero(~tok_multi).flatten(), torch.nonzero(tok_multi).flatten())
            self._token_table, self._token_lens = md.slot_table[~multi], md.seq_lens[~multi]
            sub_lens = extend_lens[multi]
            sub_indptr = torch.zeros(
                int(multi.sum()) + 1, dtype=md.qo_indptr.dtype, device=md.qo_indptr.device
            )
            sub_indptr[1:] = torch.cumsum(sub_lens, 0)
            seq = md.seq_lens[multi]
            self._plan_reference(
                seq,
                md.prefix_lens[multi],
                md.slot_table[multi],
                sub_indptr,
                md.max_extend_len,
                int(seq.max()),
            )
            return
        if short:
            # A short extend (speculative verify, jump-forward, a small chunk) is one decode query per new
            # token: token t of request r attends over r's first prefix_len + j + 1 slots (causal).
            req = torch.repeat_interleave(torch.arange(md.batch_size), extend_lens)
            j = torch.arange(int(md.qo_indptr[-1])) - md.qo_indptr[:-1][req]
            self._token_table = md.slot_table[req]
            self._token_lens = md.prefix_lens[req] + j + 1
            return
        if apart and (md.batch_size > 1 or int(md.prefix_lens[0]) > 0):
            starts, prefixes = md.qo_indptr.tolist(), md.prefix_lens.tolist()
            self._requests = [
                (starts[r], starts[r + 1], cpu_cascade.slot_run(md.slot_table[r, :p]) if p else None)
                for r, p in enumerate(prefixes)
            ]
            return
        self._plan_reference(
            md.seq_lens, md.prefix_lens, md.slot_table, md.qo_indptr, md.max_extend_len, md.max_seq_len
        )

    def _plan_reference(
        self,
        seq_lens: torch.Tensor,
        prefix_lens: torch.Tensor,
        slot_table: torch.Tensor,
        qo_indptr: torch.Tensor,
        max_extend_len: int,
        max_seq_len: int,
    ) -> None:
        """The gather + SDPA path's tables and mask for these requests."""
        dev = seq_lens.device
        kv_pos = torch.arange(max_seq_len, device=dev)
        kv_ok = kv_pos[None, :] < seq_lens[:, None]
        # Padding positions read slot 0 (the reserved padding target); the mask hides them.
        self._slot_table = torch.where(kv_ok, slot_table[:, :max_seq_len], 0)
        # Query table [B, max_extend_len] of flat token indices.
        extend_lens = qo_indptr[1:] - qo_indptr[:-1]
        q_pos = torch.arange(max_extend_len, device=dev)
        self._q_valid = q_pos[None, :] < extend_lens[:, None]
        self._q_index = torch.where(self._q_valid, qo_indptr[:-1, None] + q_pos[None, :], 0)
        self._ref_shape = (int(seq_lens.shape[0]), max_extend_len)
        self._additive = None
        self._causal = False
        if max_extend_len == 1 and self.sliding_window is None:
            self._mask = kv_ok[:, None, None, :]
            return
        if seq_lens.shape[0] == 1 and self.sliding_window is None and int(prefix_lens[0]) == 0:
            # One request's plain prefill: SDPA's own causal mask (no mask tensor to read per layer).
            self._mask, self._causal = None, True
            return
        abs_q = prefix_lens[:, None] + q_pos[None, :]  # [B, Q] absolute position of each query
        mask = kv_ok[:, None, :] & (kv_pos[None, None, :] <= abs_q[:, :, None])
        if self.sliding_window is not None:
            mask &= kv_pos[None, None, :] > abs_q[:, :, None] - self.sliding_window
        # Padded query rows attend to position 0 only (their output is dropped) to avoid NaN rows.
        mask[:, :, 0] |= ~self._q_valid
        self._mask = mask[:, None, :, :]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: AttentionMetadata
    ) -> torch.Tensor:
        self.kv.set_kv(layer_id, md.out_cache_loc, k, v)
        k_buf, v_buf = self.kv.get_kv_buffer(layer_id)
        scales = self.scaled_kv.kv_scales(layer_id) if self.scaled_kv is not None else None
        ks, vs = (None, None) if scales is None else scales
        if self._split is not None:
            single, multi = self._split
            out = torch.empty_like(q)
            if single.numel() and self._token_table is not None:
                out[single] = cpu_decode.paged_decode_attention(
                    q[single], k_buf, v_buf, self._token_table, self._token_lens, self.scale,
                    self.sliding_window, k_scale=ks, v_scale=vs,
                )  # fmt: skip
            out[multi] = self._reference(q[multi], k_buf, v_buf, ks, vs)
            return out
        if self._cascade is not None:
            return cpu_cascade.cascade_decode_attention(q, k_buf, v_buf, self._cascade, self.scale)
        if self._token_table is not None:
            return cpu_decode.paged_decode_attention(
                q, k_buf, v_buf, self._token_table, self._token_lens, self.scale, self.sliding_window,
                k_scale=ks, v_scale=vs,
            )  # fmt: skip
        if self._requests is not None:
            return self._apart(q, k, v, k_buf, v_buf, self._requests)
        if self._causal and not self.kv_fp8:  # one request's plain prefill: its own K/V, nothing gathered
            return self._prefill(q, k, v)
        if self._extend_kernel:
            return cpu_extend.paged_extend_attention(
                q,
                k_buf,
                v_buf,
                md.slot_table,
                md.qo_indptr,
                md.seq_lens,
                self.scale,
                self.sliding_window,
                k_scale=ks,
                v_scale=vs,
            )
        return self._reference(q, k_buf, v_buf, ks, vs)

    def _apart(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        requests: list[tuple[int, int, torch.Tensor | slice | None]],
    ) -> torch.Tensor:
        """Each request's new tokens over its cached prefix (`cpu_cascade.extend_over_prefix`) or, with none,
        over themselves."""

        def one(
            qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, prefix: torch.Tensor | slice | None
        ) -> torch.Tensor:
            if prefix is None:
                return self._prefill(qr, kr, vr)
            return cpu_cascade.extend_over_prefix(qr, kr, vr, k_buf, v_buf, prefix, self.scale)

        if len(requests) == 1:  # the batch's tokens are the request's: no output copy
            return one(q, k, v, requests[0][2])
        out = torch.empty_like(q)
        for start, end, prefix in requests:
            out[start:end] = one(q[start:end], k[start:end], v[start:end], prefix)
        return out

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of one request's new tokens ``[T, H or KVH, D]`` over themselves (padded to an
        aligned length: `cpu_cascade.pad_tokens`)."""
        t = q.shape[0]
        out = F.scaled_dot_product_attention(
            cpu_cascade.pad_tokens(q, 0).transpose(0, 1)[None],
            cpu_cascade.pad_tokens(k, 0).transpose(0, 1)[None],
            cpu_cascade.pad_tokens(v, 0).transpose(0, 1)[None],
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out[0, :, :t].transpose(0, 1)

    def _reference(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        ks: torch.Tensor | None,
        vs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Gather + SDPA over the requests `_plan_reference` planned; ``q`` holds exactly their new tokens."""
        batch, max_extend_len = self._ref_shape
        keys = k_buf[self._slot_table].transpose(1, 2)  # [B, KVH, L, D]
        values = v_buf[self._slot_table].transpose(1, 2)
        if self.kv_fp8:
            keys, values = self._widen(keys, values, ks, vs, q.dtype)
        if max_extend_len == 1:
            queries = q[:, :, None, :] if q.shape[0] == batch else q[self._q_index[:, 0]][:, :, None, :]
        else:
            queries = q[self._q_index].transpose(1, 2)  # [B, H, Q, D]
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=self._additive_mask(queries.dtype),
            is_causal=self._causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        if max_extend_len == 1 and q.shape[0] == batch:
            return out[:, :, 0, :]
        return out.transpose(1, 2)[self._q_valid]

    def _additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The planned mask as 0 / -inf in ``dtype``, built on the forward's first layer: SDPA converts a
        boolean mask on every call (~15% of an extend's attention over a 3k prefix, bf16, 2 threads)."""
        if self._mask is None:
            return None
        if self._additive is None or self._additive.dtype != dtype:
            additive = torch.zeros(self._mask.shape, dtype=dtype, device=self._mask.device)
            self._additive = additive.masked_fill_(~self._mask, float("-inf"))
        return self._additive

    @staticmethod
    def _widen(
        keys: torch.Tensor,
        values: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered float8 K/V ``[B, KVH, L, D]`` in ``dtype``, times the scales (e4m3; ``k_scale``
        ``[KVH]`` or ``[KVH, D]``, ``v_scale`` ``[KVH]``)."""
        k, v = dequantize_fp8(keys), dequantize_fp8(values)
        if k_scale is not None:  # powers of two: exact
            k = k * (k_scale[:, None, :] if k_scale.dim() == 2 else k_scale[:, None, None])
        if v_scale is not None:
            v = v * v_scale[:, None, None]
        return k.to(dtype), v.to(dtype)
