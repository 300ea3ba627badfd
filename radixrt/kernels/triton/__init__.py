"""Triton attention kernels over the paged KV pool (GPU; on CPU only under ``TRITON_INTERPRET=1``).

``decode_attention_fwd`` is one query token per request (split-K over the KV length, then a log-sum-exp
merge); ``extend_attention_fwd`` is ragged causal attention of new tokens over their cached prefix plus
themselves. Both find a request's KV slots through a ``KVIndex`` (the page table or the slot table).
Importing this package imports triton; ``radixrt.kernels.triton_backend`` is the only importer.
"""

from __future__ import annotations

from radixrt.kernels.triton.common import KVIndex
from radixrt.kernels.triton.decode_attention import (
    DecodeWorkspace,
    alloc_decode_workspace,
    decode_attention_fwd,
)
from radixrt.kernels.triton.extend_attention import extend_attention_fwd

__all__ = [
    "DecodeWorkspace",
    "KVIndex",
    "alloc_decode_workspace",
    "decode_attention_fwd",
    "extend_attention_fwd",
]
