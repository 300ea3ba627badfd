"""Per-layer K/V buffers indexed by token slot (the one place that knows the KV layout and its dtype).

The buffers hold the model's dtype, or with ``--kv-cache-dtype fp8_e5m2|fp8_e4m3`` torch's float8 dtypes:
``set_kv`` quantizes what it stores (dividing by the scale for e4m3, saturating at the format's largest
finite value) and attention backends dequantize what they read with ``kv_scales``. e4m3 scales are per head;
per-channel key scales (``per_channel_k``) are supported (the scale tensors are per channel, the C kernels
fold them into the query for free) but measured no better on the embedded model: e4m3's relative precision
is the same at any scale down to its subnormals, and a channel quiet during calibration can saturate later
(docs/cache.md "FP8 KV"). Scales are powers of two, so dividing by one is exact and the only rounding is
the cast to float8.

e4m3 keys are also *centred*: the pool stores ``k - k_offset`` (``k_offset``: the per-channel midpoint of the
calibrated key range, after rotary). Attention needs no correction: a query's scores against every key of a
sequence shift by the same ``q . k_offset``, which softmax ignores. What changes is the rounding error, which is
relative to what is stored: keys carry channels with a large common offset, and those lose most precision.
"""

from __future__ import annotations

import torch

from radixrt.kernels.fp8 import is_fp8, quantize_fp8, store_e4m3

KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3")
FP8_DTYPES = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
# e4m3 scales leave this much headroom over the calibrated |K|/|V| maxima (values past it saturate).
E4M3_HEADROOM = 4.0
# A key channel's scale is at least its head's scale times this: a channel nearly silent during calibration
# must not saturate later (e4m3's relative precision is the same at any scale down to its subnormals, so a
# smaller scale gains nothing there).
K_CHANNEL_FLOOR = 2.0**-8


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV buffers store: the model's for ``auto``, else the float8 format named."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} not in {KV_CACHE_DTYPES}")
    return FP8_DTYPES[kv_cache_dtype]


def pow2_scale(amax: torch.Tensor, fmax: float, headroom: float = E4M3_HEADROOM) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax * headroom / s <= fmax`` (1 where amax is 0)."""
    want = (amax.float() * headroom / fmax).clamp_min(2.0**-30)
    return torch.exp2(torch.ceil(torch.log2(want)))


class KVPool:
    """K and V buffers of shape ``[num_slots, kv_heads, head_dim]`` for every layer.

    Slot ``s`` of page ``p`` is ``p * page_size + offset``, so the buffers are page-major too. ``dtype``
    is the stored dtype (``store_dtype``, default the model's ``model_dtype``). With e4m3 storage,
    ``k_scale`` (``[layers, kv_heads, head_dim]``, per channel; ``per_channel_k`` False: one per head,
    broadcast over the channels) and ``v_scale`` (``[layers, kv_heads]``), float32 powers of two, are set by
    ``end_calibration`` before anything is stored; until then they are 1. ``lazy`` buffers are
    ``torch.empty`` (pages commit only when written; used by the host tier).
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        store_dtype: torch.dtype | None = None,
        lazy: bool = False,
        per_channel_k: bool = False,
        center_k: bool = True,
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.model_dtype = dtype
        self.dtype = store_dtype or dtype
        make = torch.empty if lazy else torch.zeros
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [make(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [make(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.per_channel_k, self.center_k = per_channel_k, center_k
        self.k_offset: torch.Tensor | None = None
        if self.dtype == torch.float8_e4m3fn:
            self.k_scale = torch.ones(num_layers, num_kv_heads, head_dim, device=device)
            self.k_offset = torch.zeros(num_layers, num_kv_heads, head_dim, device=device)
            self.v_scale = torch.ones(num_layers, num_kv_heads, device=device)
        self._calib: list[torch.Tensor] | None = None

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one token's K and V take across all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def size_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)

    @property
    def quantized(self) -> bool:
        return is_fp8(self.dtype)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def plain_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Every layer's K and V buffers when `set_kv` is a plain row copy into them (no float8 scaling), so a
        native op may store the rows itself; None otherwise."""
        return None if self.quantized else (self.k_buffers, self.v_buffers)

    def kv_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k_scale [KVH, D], v_scale [KVH])`` float32 that dequantize layer ``layer_id``'s stored values
        (``stored.float() * scale``, per channel for K, per head for V), or None when no scale applies."""
        if self.k_scale is None or self.v_scale is None:
            return None
        return self.k_scale[layer_id], self.v_scale[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.quantized:
            self.k_buffers[layer_id][loc] = k.to(self.dtype)
            self.v_buffers[layer_id][loc] = v.to(self.dtype)
            return
        if self._calib is not None:  # calibrating: record K's max and -min per channel, |V|'s max per head
            kf = k.detach().float()
            v_amax = v.detach().abs().amax(dim=(0, 2)).float()
            amax = torch.cat([kf.amax(dim=0), (-kf).amax(dim=0), v_amax[:, None]], dim=1).cpu()
            self._calib[layer_id] = torch.maximum(self._calib[layer_id], amax)
        scales = self.kv_scales(layer_id)
        ks, vs = (None, None) if scales is None else scales
        if self.k_offset is not None:
            assert ks is not None and vs is not None
            kb, vb, off = self.k_buffers[layer_id], self.v_buffers[layer_id], self.k_offset[layer_id]
            if store_e4m3(k, v, ks, off, vs, kb, vb, loc):  # one C call on CPU; the same bytes as below
                return
            k = k.float() - off
        self.k_buffers[layer_id][loc] = quantize_fp8(k, self.dtype, ks)
        self.v_buffers[layer_id][loc] = quantize_fp8(v, self.dtype, vs)

    # -- e4m3 scales ----------------------------------------------------------------------------
    def begin_calibration(self) -> None:
        """Record K's range per channel and |V|'s maximum per head of every ``set_kv`` until
        ``end_calibration`` (one ``[KVH, 2 D + 1]`` record per layer: K's maxima, minus its minima, V)."""
        D = self.head_dim
        init = torch.cat(
            [torch.full((self.num_kv_heads, 2 * D), -torch.inf), torch.zeros(self.num_kv_heads, 1)], 1
        )
        self._calib = [init.clone() for _ in range(self.num_layers)]

    def end_calibration(self) -> None:
        """Fix the e4m3 key offsets and scales from the recorded ranges (no-op for other dtypes)."""
        calib, self._calib = self._calib, None
        if calib is None or self.k_scale is None or self.v_scale is None or self.k_offset is None:
            return
        rec = torch.stack(calib)  # [layers, KVH, 2 D + 1]
        fmax = torch.finfo(self.dtype).max
        D = self.head_dim
        k_max, k_neg_min, v_amax = rec[..., :D], rec[..., D : 2 * D], rec[..., -1]
        if self.center_k:  # the midpoint of each channel's range; what is stored spans +-half the range
            self.k_offset.copy_((k_max - k_neg_min) / 2)
            k_amax = (k_max + k_neg_min) / 2
        else:
            k_amax = torch.maximum(k_max, k_neg_min)
        head = pow2_scale(k_amax.amax(dim=-1, keepdim=True), fmax)
        k_scale = (
            torch.maximum(pow2_scale(k_amax, fmax), head * K_CHANNEL_FLOOR) if self.per_channel_k else head
        )
        self.k_scale.copy_(k_scale.expand_as(self.k_scale))
        self.v_scale.copy_(pow2_scale(v_amax, fmax))

    def scales_bytes(self) -> bytes:
        """The scales' and key offsets' bytes (part of the disk tier's identity: stored values mean nothing
        without them)."""
        if self.k_scale is None or self.v_scale is None or self.k_offset is None:
            return b""
        return b"".join(t.cpu().numpy().tobytes() for t in (self.k_scale, self.v_scale, self.k_offset))

    # -- copies between pools (the tiers) ---------------------------------------------------------
    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K and V of ``slots``, ``[layers, n, KVH, D]`` each (a copy, on the host)."""
        idx = slots.to(self.k_buffers[0].device)
        k = torch.stack([b[idx] for b in self.k_buffers]).cpu()
        v = torch.stack([b[idx] for b in self.v_buffers]).cpu()
        return k, v

    def write_slots(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store raw values (already in this pool's dtype, ``[layers, n, KVH, D]``) at ``slots``."""
        dev = self.k_buffers[0].device
        idx = slots.to(dev)
        for layer in range(self.num_layers):
            self.k_buffers[layer][idx] = k[layer].to(dev)
            self.v_buffers[layer][idx] = v[layer].to(dev)

    def copy_to(self, dst: KVPool, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the stored bytes of ``src_slots`` into ``dst``'s ``dst_slots`` (same layout and dtype)."""
        sdev, ddev = self.k_buffers[0].device, dst.k_buffers[0].device
        si, di = src_slots.to(sdev), dst_slots.to(ddev)
        for layer in range(self.num_layers):
            dst.k_buffers[layer][di] = self.k_buffers[layer][si].to(ddev)
            dst.v_buffers[layer][di] = self.v_buffers[layer][si].to(ddev)
