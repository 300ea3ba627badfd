"""The Mooncake transfer engine backend (``pip install 'radixrt[pd]'``; Debian: libibverbs1 librdmacm1).

Each side starts a TransferEngine with peer-to-peer handshake (no metadata server) on TCP, or RDMA when
``--disaggregation-ib-device`` names devices, and registers its pool's buffers; the prefill side writes a
prompt's rows straight into the decode pool with one batched synchronous write.
"""

from __future__ import annotations

from radixrt.disaggregation.transfer import TransferBackend, pool_buffers, slot_runs
from radixrt.mem_cache.kv_pool import KVPool


class MooncakeBackend(TransferBackend):
    """Writes through ``mooncake.engine.TransferEngine`` (pool buffers registered once, at start)."""

    def __init__(self, pool: KVPool, host: str, ib_device: str | None) -> None:
        super().__init__(pool)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ValueError(
                "disaggregation_transfer_backend: mooncake is not importable (pip install 'radixrt[pd]'; it "
                f"needs Debian's libibverbs1 and librdmacm1): {exc}"
            ) from exc
        if pool.k_buffers[0].device.type != "cpu":
            raise ValueError(
                "disaggregation_transfer_backend: the mooncake backend here moves host memory only"
            )
        self._engine = TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, ib_device or "")
        if rc != 0:
            raise OSError(
                f"mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol}) returned {rc}"
            )
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        for buf in pool_buffers(pool):
            ptr, size = buf.data_ptr(), buf.numel() * buf.element_size()
            rc = self._engine.register_memory(ptr, size)
            if rc != 0:
                raise OSError(f"mooncake register_memory of a {size}-byte KV buffer returned {rc}")
            self._registered.append(ptr)

    @property
    def session(self) -> str:
        return self._session

    def write(self, session: str, dst_ptrs: list[int], src_slots: list[int], dst_slots: list[int]) -> bytes:
        src_bufs = pool_buffers(self.pool)
        if len(dst_ptrs) != len(src_bufs):
            raise OSError(f"the decode pool has {len(dst_ptrs)} buffers, this one {len(src_bufs)}")
        rb = self.row_bytes
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for s, d, n in slot_runs(src_slots, dst_slots):
            for buf, dst_base in zip(src_bufs, dst_ptrs, strict=True):
                srcs.append(buf.data_ptr() + s * rb)
                dsts.append(dst_base + d * rb)
                lens.append(n * rb)
        if srcs:
            rc = self._engine.batch_transfer_sync_write(session, srcs, dsts, lens)
            if rc != 0:
                raise OSError(f"mooncake batch_transfer_sync_write to {session} returned {rc}")
        return b""

    def accept(self, dst_slots: list[int], payload: bytes) -> None:
        if payload:
            raise OSError("mooncake backend: the KV arrives through the engine, not in the message")

    def close(self) -> None:
        for ptr in self._registered:
            self._engine.unregister_memory(ptr)
        self._registered.clear()
