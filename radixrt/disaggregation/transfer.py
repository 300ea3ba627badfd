"""Transfer backends: how a prompt's KV pages move from the prefill pool into the decode pool.

Both sides hold a `KVPool` of the same geometry (layers, KV heads, head dim, dtype). A token's K (and V)
for one layer is one row of ``row_bytes`` at ``buffer.data_ptr() + slot * row_bytes``, so a run of
consecutive slots on both sides is one contiguous copy per buffer.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

import torch

from radixrt.mem_cache.kv_pool import KVPool


def pool_buffers(pool: KVPool) -> list[torch.Tensor]:
    """The pool's K buffers then V buffers (the order of `KVRequest.dst_ptrs`)."""
    return [*pool.k_buffers, *pool.v_buffers]


def pool_layout(pool: KVPool) -> str:
    """The pool's geometry, dtype and (fp8) scales: two pools exchange pages only when these are equal."""
    scales = hashlib.sha256(pool.scales_bytes()).hexdigest()[:16]
    return (
        f"layers={pool.num_layers} kv_heads={pool.num_kv_heads} head_dim={pool.head_dim} "
        f"dtype={pool.dtype} scales={scales}"
    )


def row_bytes(pool: KVPool) -> int:
    """Bytes of one slot in one buffer."""
    buf = pool.k_buffers[0]
    return buf[0].numel() * buf.element_size()


def slot_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs where both slot lists advance by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class TransferBackend(ABC):
    """One worker's end of the KV transfer (both sides build the same backend)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.row_bytes = row_bytes(pool)
        self.layout = pool_layout(pool)

    @property
    @abstractmethod
    def session(self) -> str:
        """This side's address for the transfer engine ('' when it needs none)."""

    def dst_ptrs(self) -> list[int]:
        """Addresses of this (decode) pool's buffers, sent to the prefill side."""
        return [b.data_ptr() for b in pool_buffers(self.pool)]

    @abstractmethod
    def write(self, session: str, dst_ptrs: list[int], src_slots: list[int], dst_slots: list[int]) -> bytes:
        """Prefill side: copy ``src_slots``' KV into the peer's ``dst_slots``. Returns the bytes the
        control message must carry (empty when the pages were written remotely). Raises OSError on failure."""

    @abstractmethod
    def accept(self, dst_slots: list[int], payload: bytes) -> None:
        """Decode side: the pages of ``dst_slots`` arrived (store ``payload`` when the backend carries them)."""

    def close(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing)
        """Release the backend's resources."""


class FakeBackend(TransferBackend):
    """The KV bytes travel inside the KVDone message (ZeroMQ over TCP): no transfer engine needed.

    Unlike SGLang's ``fake`` (which moves nothing), the pages do arrive, so outputs are exact; the cost is
    a copy through the control socket, fine for tests and small prompts, not for production sizes."""

    @property
    def session(self) -> str:
        return ""

    def write(self, session: str, dst_ptrs: list[int], src_slots: list[int], dst_slots: list[int]) -> bytes:
        if len(src_slots) != len(dst_slots):
            raise OSError(f"{len(src_slots)} source slots for {len(dst_slots)} destination slots")
        k, v = self.pool.read_slots(torch.tensor(src_slots, dtype=torch.int64))
        both = torch.stack([k, v]).contiguous()
        return bytes(both.view(torch.uint8).numpy().tobytes())

    def accept(self, dst_slots: list[int], payload: bytes) -> None:
        pool = self.pool
        n = len(dst_slots)
        expect = 2 * pool.num_layers * n * self.row_bytes
        if len(payload) != expect:
            raise OSError(f"KV payload of {len(payload)} bytes for {n} tokens (expected {expect})")
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(pool.dtype)
        both = flat.reshape(2, pool.num_layers, n, pool.num_kv_heads, pool.head_dim)
        pool.write_slots(torch.tensor(dst_slots, dtype=torch.int64), both[0], both[1])
