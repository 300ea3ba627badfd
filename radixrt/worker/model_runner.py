"""ModelRunner: owns the model, the KV memory pools and the attention backend; runs one forward."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from radixrt.config.server_args import ServerArgs
from radixrt.config.speculative_args import draft_tokens
from radixrt.distributed.tensor_parallel import check_divisible, shard_model
from radixrt.distributed.tp_group import FollowerEntry, TPGroup, init_group, ranks_of_node
from radixrt.kernels.base import AttentionMetadata, ForwardMode, KVStore, get_backend_class
from radixrt.kernels.fp8 import is_fp8
from radixrt.kernels.layer_windows import build_backend
from radixrt.mem_cache.allocator import TokenSlotAllocator
from radixrt.mem_cache.kv_pool import KVPool, kv_storage_dtype
from radixrt.mem_cache.req_to_token import ReqToTokenPool
from radixrt.mem_cache.swa_pool import LayerGroupKV, SWAAllocator
from radixrt.models.config import ModelConfig, cpu_has_native_bf16
from radixrt.models.gguf import gguf_source
from radixrt.models.loader import load_model
from radixrt.models.quantize import apply_quantization, resolve_quantization
from radixrt.worker.cuda_graph_runner import CudaGraphRunner
from radixrt.worker.device import kv_budget_bytes, resolve_attention_backend, resolve_device, resolve_dtype
from radixrt.worker.extend_graphs import ExtendGraphRunner, compiled_extend_enabled
from radixrt.worker.graph_runner import DecodeGraphRunner, verify_buckets
from radixrt.worker.step_cost import attention_work

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ForwardInput:
    """One ragged batch: per request its pool row, cached length and the new tokens to compute."""

    mode: ForwardMode
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    positions: torch.Tensor


class ModelRunner:
    """Loads the checkpoint and sizes the KV pool; ``forward`` runs the model on a ForwardInput.

    With ``--tp-size`` > 1, rank 0 starts this node's other ranks, each running ``tp_follower`` (the
    worker's `radixrt.worker.tp_follower.follower_main`, handed in by whoever builds rank 0's runner).
    """

    def __init__(
        self,
        args: ServerArgs,
        model_path: str | Path,
        tp_rank: int = 0,
        tp_follower: FollowerEntry | None = None,
    ) -> None:
        self.args = args
        self.tp_rank = tp_rank
        self.tp_follower = tp_follower
        self.device = resolve_device(args.device)
        self.config = ModelConfig.from_dir(
            model_path, dtype=resolve_dtype(args.dtype, self.device), context_length=args.context_length
        )
        cfg = self.config
        if args.dtype == "auto" and self.device.type == "cpu":
            native = "has" if cpu_has_native_bf16() else "lacks"
            logger.info(
                "dtype auto -> %s (this CPU %s native bf16)", str(cfg.dtype).removeprefix("torch."), native
            )
        self.context_len = min(
            args.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        torch.manual_seed(args.random_seed)
        self.model = load_model(model_path, cfg, self.device)
        gguf_file = gguf_source(model_path)
        self.tp: TPGroup | None = None
        tp = args.tp_size
        if tp > 1:
            self.quantization = self._init_tensor_parallel(model_path, gguf_file)
        else:
            self.quantization = resolve_quantization(
                args.quantization, gguf_file, cfg.dtype, args.int4_kernel
            )
            apply_quantization(
                self.model, self.quantization, Path(model_path), gguf_file, args.dense_gemm_min_tokens,
                args.int4_kernel, args.dense_gemm_int8,
            )  # fmt: skip
        kv_heads = cfg.num_kv_heads // tp
        kv_dtype = kv_storage_dtype(args.kv_cache_dtype, cfg.dtype)
        if is_fp8(kv_dtype) and tp > 1:
            raise ValueError("kv_cache_dtype: fp8 KV is not supported with tp_size > 1 yet")
        windows = [cfg.window_of(i) for i in range(cfg.num_layers)]
        self.swa_window = (
            swa_window_of(cfg.architecture, windows, self.device) if args.enable_swa_cache else None
        )
        n_local = sum(w is not None for w in windows) if self.swa_window is not None else 0
        ratio = args.swa_full_tokens_ratio
        per_layer = KVPool.bytes_per_token(1, kv_heads, cfg.head_dim, kv_dtype)
        per_token = per_layer * (cfg.num_layers - n_local + ratio * n_local)
        if args.max_total_tokens is not None:
            num_slots = args.max_total_tokens
        else:
            num_slots = int(kv_budget_bytes(self.device, args.mem_fraction_static) // per_token)
            num_slots = max(min(num_slots, 1 << 22), 4 * self.context_len)
        if tp > 1:  # every rank sizes its pool shard like rank 0's
            box = [num_slots]
            dist.broadcast_object_list(box, src=0)
            num_slots = box[0]
        ps = args.page_size
        num_slots = (num_slots + ps) // ps * ps  # one extra page for the reserved padding page
        self.kv_pool = KVPool(
            num_slots, cfg.num_layers - n_local, kv_heads, cfg.head_dim, cfg.dtype, self.device,
            store_dtype=kv_dtype,
        )  # fmt: skip
        # NOTE: slot bookkeeping (free lists, the request -> slot table, the RadixCache's slots) stays on
        # the host on every device: metadata is built there and copied once per forward.
        self.allocator: TokenSlotAllocator | SWAAllocator = TokenSlotAllocator(num_slots, ps)
        # With --enable-swa-cache: the local layers' pool (kv_pool holds the global layers only).
        self.swa_pool: KVPool | None = None
        kv_store: KVStore = self.kv_pool
        if self.swa_window is not None:
            swa_slots = (int(num_slots * ratio) + ps) // ps * ps  # one extra page for the padding page
            budget = args.chunked_prefill_size if args.chunked_prefill_size > 0 else args.max_prefill_tokens
            least = 2 * (budget + self.swa_window) + 4 * ps
            if swa_slots - ps < least:
                raise ValueError(
                    f"swa_full_tokens_ratio: the local layers' pool ({swa_slots - ps} tokens) must hold at least "
                    f"{least} (twice a prefill chunk of {budget} plus the window of {self.swa_window}): raise "
                    "--swa-full-tokens-ratio or --max-total-tokens, or lower --chunked-prefill-size"
                )
            self.swa_pool = KVPool(swa_slots, n_local, kv_heads, cfg.head_dim, cfg.dtype, self.device)
            self.allocator = SWAAllocator(num_slots, swa_slots, ps)
            kv_store = LayerGroupKV(self.kv_pool, self.swa_pool, [w is not None for w in windows])
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests + 8, self.context_len + ps)
        self.attention_backend = resolve_attention_backend(args.attention_backend, self.device)
        backend_cls = get_backend_class(self.attention_backend)
        self.backend = build_backend(
            backend_cls,
            kv_store,
            cfg.num_heads // tp,
            kv_heads,
            cfg.head_dim,
            cfg.softmax_scale,
            windows,
            self.allocator.full_to_swa if isinstance(self.allocator, SWAAllocator) else None,
        )
        if is_fp8(kv_dtype) and self.attention_backend != "torch_native":
            raise ValueError(
                f"kv_cache_dtype {args.kv_cache_dtype}: only the torch_native attention backend reads "
                f"float8 KV so far, not {self.attention_backend}"
            )
        self.graph_runner: DecodeGraphRunner | None = None
        self.extend_runner: ExtendGraphRunner | None = None
        self.cuda_graph_runner: CudaGraphRunner | None = None
        if self.kv_pool.k_scale is not None:
            self._calibrate_kv_scales()
        if tp > 1:
            logger.info(
                "tensor parallel rank %d/%d: decode runs eagerly (no compile or CUDA graphs)", tp_rank, tp
            )
        elif self.device.type == "cuda" and cfg.moe is not None:
            logger.info("mixture of experts on cuda: decode runs eagerly (a CUDA graph cannot capture the "
                        "data-dependent expert grouping)")  # fmt: skip
        elif self.device.type == "cuda":
            self._init_cuda_graphs()
        elif not args.disable_compile:
            self.graph_runner = DecodeGraphRunner(
                self.model,
                self.backend,
                args.compile_max_bs,
                args.compile_scope,
                verify_buckets(args.speculative_max_batch_size, draft_tokens(args))
                if args.speculative_algorithm is not None
                else [],
                native_attention=args.speculative_algorithm is None,
            )
            self.graph_runner.warmup(self._run_padding_batch)
            if args.speculative_algorithm is not None:
                self._calibrate_step_cost(self.graph_runner)
            if compiled_extend_enabled():
                self.extend_runner = ExtendGraphRunner(self.model, self.backend)
                self.extend_runner.warmup(self._run_padding_extend)
        logger.info(
            "model %s (%s, %s, quantization %s): KV pool %d tokens, %.1f MiB, page_size %d",
            model_path,
            cfg.architecture,
            str(cfg.dtype).removeprefix("torch."),
            self.quantization,
            self.allocator.total_slots,
            self.kv_pool.size_bytes / 2**20,
            ps,
        )
        if self.swa_pool is not None:
            logger.info(
                "sliding-window cache: window %d, local layers' pool %d tokens, %.1f MiB",
                self.swa_window, self.swa_pool.num_slots - ps, self.swa_pool.size_bytes / 2**20,
            )  # fmt: skip

    def _init_tensor_parallel(self, model_path: str | Path, gguf_file: Path | None) -> str:
        """Join the group (rank 0 starts the followers first) and keep this rank's shard."""
        args = self.args
        if args.quantization not in (None, "none"):
            raise ValueError(f"quantization: {args.quantization!r} with tp_size > 1; tensor parallelism runs "
                             "unquantized weights (--quantization none)")  # fmt: skip
        if gguf_file is not None:
            logger.info("tensor parallel: the GGUF weights run dequantized (quantization none)")
        cfg = self.config
        check_divisible(cfg, args.tp_size)
        if self.tp_rank == 0:
            if self.tp_follower is None:
                raise ValueError("tp_size: rank 0 needs the follower entry to start the other ranks")
            torch.set_num_threads(max(1, torch.get_num_threads() // len(ranks_of_node(args))))
            self.tp = TPGroup(args, str(model_path), self.tp_follower)
        else:
            init_group(args, self.tp_rank)
        shard_model(self.model, self.tp_rank, args.tp_size)
        return "none"

    def close(self) -> None:
        """Stop the tensor-parallel followers (rank 0); nothing to do otherwise."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    def _calibrate_kv_scales(self, num_tokens: int = 256) -> None:
        """e4m3 KV: per-head scales from the |K| / |V| maxima of one prefill of fixed pseudo-random tokens
        (deterministic, so a restarted server gets the same scales and its disk tier stays valid)."""
        n = min(num_tokens, self.context_len - 1, self.allocator.total_slots - 1)
        vocab = self.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(min(100, vocab // 2), vocab, (n,), generator=gen).tolist()
        row, slots = self.req_to_token_pool.alloc(), self.allocator.alloc(n)
        assert row is not None and slots is not None
        self.req_to_token_pool.req_to_token[row, :n] = slots
        self.kv_pool.begin_calibration()
        try:
            self.forward(ForwardInput(ForwardMode.EXTEND, [row], [0], [n], ids, torch.arange(n)))
        finally:
            self.kv_pool.end_calibration()
            self.allocator.free(slots)
            self.req_to_token_pool.free(row)

    def _init_cuda_graphs(self) -> None:
        if self.args.disable_cuda_graph:
            return
        if not self.backend.supports_cuda_graph:
            logger.warning(
                "attention backend %s cannot be captured in CUDA graphs: decode runs without them",
                self.attention_backend,
            )
            return
        self.cuda_graph_runner = CudaGraphRunner(
            self.model,
            self.backend,
            self.args.cuda_graph_max_bs,
            self.context_len + self.args.page_size,
            self.args.page_size,
            self.device,
        )
        self.cuda_graph_runner.capture()

    def build_metadata(self, fi: ForwardInput) -> AttentionMetadata:
        """Paged metadata (FlashInfer layout) for a batch whose slots are already in req_to_token; built on
        the host (where the slot tables live)."""
        dev = torch.device("cpu")
        ps = self.args.page_size
        rows = torch.tensor(fi.rows, dtype=torch.int64, device=dev)
        prefix = torch.tensor(fi.prefix_lens, dtype=torch.int64, device=dev)
        extend = torch.tensor(fi.extend_lens, dtype=torch.int64, device=dev)
        seq = prefix + extend
        max_seq = max(p + e for p, e in zip(fi.prefix_lens, fi.extend_lens, strict=True))
        qo_indptr = torch.zeros(len(fi.rows) + 1, dtype=torch.int64, device=dev)
        qo_indptr[1:] = torch.cumsum(extend, 0)
        num_pages = (seq + ps - 1) // ps
        kv_indptr = torch.zeros_like(qo_indptr)
        kv_indptr[1:] = torch.cumsum(num_pages, 0)
        # One gather of the requests' slot rows serves every view below.
        slot_table = self.req_to_token_pool.req_to_token[rows, :max_seq]
        page_table = slot_table[:, ::ps] // ps
        page_ok = torch.arange(page_table.shape[1], device=dev)[None, :] < num_pages[:, None]
        kv_indices = page_table[page_ok]
        last_page_len = seq - (num_pages - 1) * ps
        pos = torch.arange(max_seq, device=dev)[None, :]
        out_cache_loc = slot_table[(pos >= prefix[:, None]) & (pos < seq[:, None])]
        return AttentionMetadata(
            mode=fi.mode,
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_last_page_len=last_page_len,
            page_size=ps,
            prefix_lens=prefix,
            seq_lens=seq,
            out_cache_loc=out_cache_loc,
            max_extend_len=max(fi.extend_lens),
            max_seq_len=max_seq,
            slot_table=slot_table,
        )

    @torch.inference_mode()
    def forward(self, fi: ForwardInput) -> torch.Tensor:
        """Run the model; returns final hidden states ``[T, hidden]`` of every new token.

        A decode batch that fits a compiled bucket is padded to it and runs the compiled step; everything
        else (extend, larger batches, ``--disable-compile``) runs eagerly.
        """
        return self._run(fi, greedy=False)

    @torch.inference_mode()
    def forward_greedy(self, fi: ForwardInput) -> torch.Tensor:
        """The argmax next token ``[T]`` of every new token: ``logits(forward(fi)).argmax(-1)``, with the
        LM head and argmax inside the compiled graph where the batch fits a bucket."""
        return self._run(fi, greedy=True)

    def _run(self, fi: ForwardInput, greedy: bool) -> torch.Tensor:
        t0 = time.perf_counter()
        bs = len(fi.input_ids)  # new tokens: one per request in a decode
        bucket = self._bucket(fi.mode, bs)
        if bucket is not None:
            work = attention_work(fi.prefix_lens, fi.extend_lens)
            fi = self._pad_decode(fi, bucket)
        md = self.build_metadata(fi)
        ids = torch.tensor(fi.input_ids, dtype=torch.int64)
        if self.cuda_graph_runner is not None and bucket is not None:
            hidden = self.cuda_graph_runner.forward(ids, fi.positions, md)[:bs]
            return torch.argmax(self.logits(hidden), dim=-1) if greedy else hidden
        if self.device.type != "cpu":
            md = md.to(self.device)
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        positions = fi.positions.to(self.device, non_blocking=True)
        if self.tp is not None:
            self.tp.forward(md, ids, positions)
        self.backend.init_forward_metadata(md)
        gr = self.graph_runner
        if gr is not None and bucket is not None:
            out = (gr.forward_greedy if greedy else gr.forward)(ids, positions, md)[:bs]
            gr.cost.observe(bucket, work, time.perf_counter() - t0, gr.last_attention_s)
            return out
        er = self.extend_runner
        if er is not None and fi.mode == ForwardMode.EXTEND and er.serves(bs):
            hidden = er.forward(ids, positions, md)
        else:
            hidden = self.model(ids, positions, self.backend, md)
        return torch.argmax(self.logits(hidden), dim=-1) if greedy else hidden

    def _bucket(self, mode: ForwardMode, tokens: int) -> int | None:
        """The compiled bucket a forward of ``tokens`` new tokens runs in, or None (eager): decodes on the
        CPU graphs or CUDA graphs, speculative verifies on the CPU graphs only (their attention is an
        opaque op that reads any metadata; a CUDA graph captured its decode kernel's plan)."""
        if mode == ForwardMode.DECODE:
            gr = self.graph_runner or self.cuda_graph_runner
            return gr.bucket(tokens) if gr is not None else None
        if mode == ForwardMode.TARGET_VERIFY and self.graph_runner is not None:
            return self.graph_runner.bucket(tokens)
        return None

    def _pad_decode(self, fi: ForwardInput, bucket: int) -> ForwardInput:
        """``fi`` with one-token requests appended up to ``bucket`` tokens: token 0 at position 0 on the
        all-zero padding row."""
        pad = bucket - len(fi.input_ids)
        if pad == 0:
            return fi
        return ForwardInput(
            fi.mode,
            fi.rows + [self.req_to_token_pool.padding_row] * pad,
            fi.prefix_lens + [0] * pad,
            fi.extend_lens + [1] * pad,
            fi.input_ids + [0] * pad,
            torch.cat([fi.positions, torch.zeros(pad, dtype=fi.positions.dtype)]),
        )

    def _calibrate_step_cost(self, gr: DecodeGraphRunner) -> None:
        """Speculation: time the compiled buckets and one request's decode and verify at a long context, and
        pick the backend's fastest verify kernel (`StepCost.calibrate`); its scratch KV is freed after."""
        k = draft_tokens(self.args)
        ctx = max(1, min(1024, self.context_len - k - 2, self.allocator.total_slots // 2))
        row, slots = self.req_to_token_pool.alloc(), self.allocator.alloc(ctx + 1 + k)
        try:
            if row is None or slots is None:
                return
            self.req_to_token_pool.req_to_token[row, : ctx + 1 + k] = slots
            empty = ForwardInput(ForwardMode.DECODE, [], [], [], [], torch.zeros(0, dtype=torch.int64))

            def run_bucket(bs: int) -> float:
                t0 = time.perf_counter()
                self.forward_greedy(self._pad_decode(empty, bs))
                return time.perf_counter() - t0

            def probe(mode: ForwardMode, context: int, n: int) -> tuple[float, float]:
                t0 = time.perf_counter()
                self.forward_greedy(
                    ForwardInput(mode, [row], [context], [n], [0] * n, torch.arange(context, context + n))
                )
                return time.perf_counter() - t0, gr.last_attention_s

            b = self.backend
            kernel = gr.cost.calibrate(run_bucket, probe, ctx, k, b.verify_kernels(), b.use_verify_kernel)
            c = gr.cost
            logger.info("speculative verify: attention kernel %s; at a %d-token context a decode row's attention "
                        "%.1f ms, a verify of %d tokens %.1f ms", kernel, ctx, (c.alpha or 0) * (ctx + 1) * 1e3,
                        k + 1, (c.per_position + (k + 1) * c.per_pair) * (ctx + k + 1) * 1e3)  # fmt: skip
        finally:
            if slots is not None:
                self.allocator.free(slots)
            if row is not None:
                self.req_to_token_pool.free(row)

    def _run_padding_batch(self, bs: int) -> None:
        """A decode forward of ``bs`` padding rows (compiles that bucket; touches only slot 0)."""
        fi = ForwardInput(ForwardMode.DECODE, [], [], [], [], torch.zeros(0, dtype=torch.int64))
        self.forward(self._pad_decode(fi, bs))
        self.forward_greedy(self._pad_decode(fi, bs))

    def _run_padding_extend(self, tokens: int) -> None:
        """An extend forward of ``tokens`` padding tokens on the padding row (compiles the extend graphs;
        touches only slot 0)."""
        row = self.req_to_token_pool.padding_row
        self.forward(
            ForwardInput(ForwardMode.EXTEND, [row], [0], [tokens], [0] * tokens, torch.arange(tokens))
        )

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            self.tp.logits(hidden)
        return self.model.logits(hidden)


def swa_window_of(architecture: str, windows: list[int | None], device: torch.device) -> int:
    """The one local window of a model whose layers are local (that window) or global (None), for
    ``--enable-swa-cache``; ValueError for any other model, or off the cpu."""
    local = {w for w in windows if w is not None}
    if len(local) != 1 or None not in windows:
        raise ValueError(
            f"enable_swa_cache: {architecture} does not interleave sliding-window layers of one window with "
            "full-attention layers (the window-aware cache is for models such as Gemma 3)"
        )
    if device.type != "cpu":
        raise ValueError(
            f"enable_swa_cache: --device {device.type} is not supported (cpu only: the GPU backends do not "
            "read the local layers' slot map)"
        )
    return local.pop()
