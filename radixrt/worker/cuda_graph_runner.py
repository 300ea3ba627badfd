"""The decode step captured as CUDA graphs, one per batch-size bucket (SGLang's CUDA-graph runner).

The buckets are the CPU compile runner's (1, 2, 4, ... up to ``--cuda-graph-max-bs``; a batch is padded
to the smallest bucket that holds it, padding rows reading and writing only the reserved padding slot).
A graph replays fixed kernels on fixed addresses, so every input lives in a static buffer sized for the
largest bucket: token ids, positions and the attention metadata (FlashInfer's layout). A replay copies the
new batch into those buffers, lets the attention backend re-plan in place
(``init_forward_metadata_replay``), then replays the bucket's graph; the output is the final hidden states
``[bucket, hidden]`` in a static buffer too. ``capture=False`` runs the same static-buffer forward without
graphs: the CPU tests use it to check the buffer plumbing (with the Triton kernels under Triton's
interpreter), which is where a captured graph would go wrong.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from tqdm import tqdm

from radixrt.kernels.base import AttentionBackend, AttentionMetadata, ForwardMode
from radixrt.models.llama import LlamaForCausalLM
from radixrt.worker.graph_runner import compile_buckets

logger = logging.getLogger(__name__)


class StaticDecodeInputs:
    """Fixed-address inputs of every bucket: sliced views of buffers sized for ``max_bs`` requests."""

    def __init__(self, max_bs: int, max_context: int, page_size: int, device: torch.device) -> None:
        def i64(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        max_pages = (max_context + page_size - 1) // page_size
        self.page_size = page_size
        self.max_context = max_context
        self.ids = i64(max_bs)
        self.positions = i64(max_bs)
        self.qo_indptr = torch.arange(
            max_bs + 1, dtype=torch.int64, device=device
        )  # one new token per request, always
        self.kv_indptr = i64(max_bs + 1)
        self.kv_indices = i64(max_bs * max_pages)
        self.kv_last_page_len = i64(max_bs) + 1
        self.prefix_lens = i64(max_bs)
        self.seq_lens = i64(max_bs) + 1
        self.out_cache_loc = i64(max_bs)
        self.slot_table = i64(max_bs, max_context)

    def metadata(self, bs: int) -> AttentionMetadata:
        """Bucket ``bs``'s view: the same tensors at every call (what a captured graph reads)."""
        return AttentionMetadata(
            mode=ForwardMode.DECODE,
            qo_indptr=self.qo_indptr[: bs + 1],
            kv_indptr=self.kv_indptr[: bs + 1],
            kv_indices=self.kv_indices,
            kv_last_page_len=self.kv_last_page_len[:bs],
            page_size=self.page_size,
            prefix_lens=self.prefix_lens[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            max_extend_len=1,
            max_seq_len=self.max_context,
            slot_table=self.slot_table[:bs],
        )

    def load(self, md: AttentionMetadata, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy a (padded) decode batch's host-built tensors into the buffers, without blocking the host."""
        bs = md.batch_size
        if md.max_seq_len > self.max_context:
            raise ValueError(
                f"decode batch reaches {md.max_seq_len} tokens > graph context {self.max_context}"
            )

        def put(dst: torch.Tensor, src: torch.Tensor) -> None:
            dst.copy_(src, non_blocking=True)

        put(self.ids[:bs], ids)
        put(self.positions[:bs], positions)
        put(self.kv_indptr[: bs + 1], md.kv_indptr)
        put(self.kv_indices[: md.kv_indices.shape[0]], md.kv_indices)
        put(self.kv_last_page_len[:bs], md.kv_last_page_len)
        put(self.prefix_lens[:bs], md.prefix_lens)
        put(self.seq_lens[:bs], md.seq_lens)
        put(self.out_cache_loc[:bs], md.out_cache_loc)
        put(self.slot_table[:bs, : md.max_seq_len], md.slot_table)


class CudaGraphRunner:
    """Runs decode forwards of up to ``max_bs`` requests by replaying per-bucket CUDA graphs."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        max_bs: int,
        max_context: int,
        page_size: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cuda device, got {device}")
        if capture and not backend.supports_cuda_graph:
            raise ValueError(f"attention backend {type(backend).__name__} cannot be captured in a CUDA graph")
        self.model = model
        self.backend = backend
        self.buckets = compile_buckets(max_bs)
        self.capture_graphs = capture
        self.inputs = StaticDecodeInputs(max_bs, max_context, page_size, device)
        self.hidden = torch.zeros(max_bs, model.norm.weight.shape[0], dtype=model.norm.weight.dtype,
                                  device=device)  # fmt: skip
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def bucket(self, bs: int) -> int | None:
        """The padded batch size for ``bs`` requests, or None when the batch is larger than every graph."""
        return next((b for b in self.buckets if b >= bs), None)

    def _step(self, bs: int) -> None:
        md = self.inputs.metadata(bs)
        out = self.model(self.inputs.ids[:bs], self.inputs.positions[:bs], self.backend, md)
        self.hidden[:bs].copy_(out)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket (largest first, sharing one memory pool); returns the seconds spent."""
        t0 = time.perf_counter()
        if not self.capture_graphs:
            return 0.0
        for bs in tqdm(sorted(self.buckets, reverse=True), desc="capturing CUDA graphs", unit="bucket"):
            md = self.inputs.metadata(bs)
            self.backend.init_forward_metadata_capture(md, bs)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: lazy inits and autotuning must not land in the graph
                    self._step(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(bs)
            self._pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.buckets, elapsed)
        return elapsed

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[bucket, hidden]`` of a padded decode batch built on the host."""
        bs = md.batch_size
        self.inputs.load(md, ids, positions)
        static_md = self.inputs.metadata(bs)
        self.backend.init_forward_metadata_replay(static_md, bs)
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._step(bs)
        return self.hidden[:bs]
