"""The attention-backend interface and the batch metadata every backend reads.

The metadata follows FlashInfer's paged-KV wrappers: per request ``qo_indptr`` (ragged query
offsets), ``kv_indptr``/``kv_indices`` (the pages of each request, in order) and
``kv_last_page_len``. It is built once per forward by the model runner and shared by all layers.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch


class ForwardMode(enum.Enum):
    """EXTEND computes new tokens after a (possibly cached) prefix; DECODE is one token per request;
    TARGET_VERIFY (SGLang's name) is a speculative verify: an extend of a few tokens per request (its last
    token and its draft; one token for an undrafted request), run through the compiled decode step where
    it fits a bucket. Backends treat it as an extend (they choose kernels by the extend lengths)."""

    EXTEND = "extend"
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"


@dataclass(slots=True)
class AttentionMetadata:
    """Ragged batch layout of one forward, shared by all layers.

    ``prefix_lens[i]`` tokens of request ``i`` are already in the KV pool; its
    ``extend_lens[i] = qo_indptr[i+1] - qo_indptr[i]`` new tokens are written at ``out_cache_loc``.
    ``seq_lens = prefix_lens + extend_lens`` is the KV length each request attends over.
    """

    mode: ForwardMode
    qo_indptr: torch.Tensor  # [B+1] int64
    kv_indptr: torch.Tensor  # [B+1] int64, offsets into kv_indices
    kv_indices: torch.Tensor  # [num_pages] int64 page ids (== slots when page_size is 1)
    kv_last_page_len: torch.Tensor  # [B] int64
    page_size: int
    prefix_lens: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    out_cache_loc: torch.Tensor  # [T] int64 slot of each new token
    max_extend_len: int
    max_seq_len: int
    # [B, max_seq_len] token slots of each request (entries past seq_lens are arbitrary): the paged
    # table expanded to tokens, for backends that gather K/V directly (torch_native).
    slot_table: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    def to(self, device: torch.device) -> AttentionMetadata:
        """A copy on ``device``: the host tensors are pinned and copied without blocking the host."""
        if self.seq_lens.device == device:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory().to(device, non_blocking=True)

        return AttentionMetadata(
            mode=self.mode,
            qo_indptr=move(self.qo_indptr),
            kv_indptr=move(self.kv_indptr),
            kv_indices=move(self.kv_indices),
            kv_last_page_len=move(self.kv_last_page_len),
            page_size=self.page_size,
            prefix_lens=move(self.prefix_lens),
            seq_lens=move(self.seq_lens),
            out_cache_loc=move(self.out_cache_loc),
            max_extend_len=self.max_extend_len,
            max_seq_len=self.max_seq_len,
            slot_table=move(self.slot_table),
        )


class KVStore(Protocol):
    """What a backend needs from the KV pool: per-layer buffers indexed by slot."""

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


class AttentionBackend(ABC):
    """Computes causal attention of new tokens over their cached prefix plus themselves.

    ``init_forward_metadata`` runs once per forward (build indices, masks, plan kernels);
    ``forward`` runs per layer: it stores the new K/V at ``out_cache_loc`` and attends.
    """

    def __init__(
        self,
        kv: KVStore,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        self.kv = kv
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    # True when the decode forward may be captured in a CUDA graph: per-layer work reads only tensors
    # that live at fixed addresses (the graph runner's static metadata and what the hooks below prepare).
    supports_cuda_graph: bool = False

    @abstractmethod
    def init_forward_metadata(self, md: AttentionMetadata) -> None:
        """Prepare per-forward state shared by every layer."""

    def init_forward_metadata_capture(self, md: AttentionMetadata, bs: int) -> None:
        """Before capturing the decode graph of bucket ``bs``: ``md`` is the graph runner's static metadata
        (the same tensors at every replay). Backends that plan into fixed buffers allocate them here."""
        self.init_forward_metadata(md)

    def init_forward_metadata_replay(self, md: AttentionMetadata, bs: int) -> None:
        """Before replaying bucket ``bs``'s graph, after the new batch was copied into ``md``'s tensors:
        update whatever the captured kernels read, in place (never by allocating new tensors)."""
        self.init_forward_metadata(md)

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: AttentionMetadata
    ) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, KVH, D] -> output [T, H, D]."""

    def verify_kernels(self) -> list[str]:
        """The kernels this backend can run a speculative verify's attention with (several new tokens per
        request), when it has a choice; the model runner times each at warm-up and keeps the fastest."""
        return []

    def use_verify_kernel(self, name: str) -> None:
        """Run TARGET_VERIFY forwards' attention with ``name`` (one of `verify_kernels`)."""
        raise ValueError(f"verify kernel: {type(self).__name__} has no choice of kernels ({name!r})")

    def native_decode_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Every layer's K and V buffers when the compiled decode step may run this backend's decode attention
        as the native op (`radixrt.kernels.decode_op`: it stores the rows and calls the C kernel itself);
        None (the default) keeps the Python op."""
        return None

    def native_decode_step(self) -> NativeStep | None:
        """After `init_forward_metadata` of a decode: the slot table, lengths and shared-prefix plan the native
        op reads, or None when this step needs the Python path."""
        return None


class SharedRun(Protocol):
    """A shared prefix of pool slots attended once for a decode batch (`radixrt.kernels.cpu_cascade`)."""

    @property
    def start(self) -> int: ...  # first slot of the run

    @property
    def length(self) -> int: ...  # slots (positions) in it

    @property
    def sharing(self) -> torch.Tensor: ...  # [B] bool: the requests that hold it

    @property
    def not_sharing(self) -> torch.Tensor | None: ...  # ~sharing, or None when every request holds it


# (slot table, seq_lens, shared prefix or None) of one decode step, for the native op.
NativeStep = tuple[torch.Tensor, torch.Tensor, SharedRun | None]


_BACKENDS: dict[str, str] = {
    "torch_native": "radixrt.kernels.torch_native:TorchNativeBackend",
    "flashinfer": "radixrt.kernels.flashinfer_backend:FlashInferBackend",
    "triton": "radixrt.kernels.triton_backend:TritonBackend",
}


def get_backend_class(name: str) -> type[AttentionBackend]:
    """Look up a backend by name, importing it lazily (GPU backends import GPU-only packages)."""
    import importlib

    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; choose one of {sorted(_BACKENDS)}")
    module_name, cls_name = _BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"attention_backend {name!r} is not available here: {exc}") from exc
    cls: type[AttentionBackend] = getattr(module, cls_name)
    return cls
