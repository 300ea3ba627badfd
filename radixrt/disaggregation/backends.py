"""The ``--disaggregation-transfer-backend`` registry: by name, the backend that moves a pool's KV (kept apart
from ``transfer`` so that the backends, which build on ``transfer``, are imported from here only)."""

from __future__ import annotations

from radixrt.disaggregation.mooncake import MooncakeBackend
from radixrt.disaggregation.transfer import FakeBackend, TransferBackend
from radixrt.mem_cache.kv_pool import KVPool


def build_backend(name: str, pool: KVPool, host: str, ib_device: str | None) -> TransferBackend:
    """The ``--disaggregation-transfer-backend`` for ``pool``."""
    if name == "fake":
        return FakeBackend(pool)
    if name == "mooncake":
        return MooncakeBackend(pool, host, ib_device)
    raise ValueError(f"disaggregation_transfer_backend: unknown backend {name!r}")
