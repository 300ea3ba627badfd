"""ServerArgs: every runtime setting, shared by Engine, the server CLI and the worker."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from typing import Any

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
EVICTION_POLICIES = ("lru", "lfu", "priority")  # priority: lower request priority evicted first, then LRU
# NOTE: radixrt.layers.QUANTIZATION_CHOICES, spelled here so that parsing flags does not import torch.
QUANTIZATION_CHOICES = ("none", "int8", "int4", "gguf")
DEVICES = ("auto", "cpu", "cuda")
# sglang-router 0.3.2's --policy choices (`radixrt serve --dp-size N` starts it in front of N servers)
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3")  # radixrt.mem_cache.kv_pool.KV_CACHE_DTYPES
HICACHE_WRITE_POLICIES = ("auto", "write_back", "write_through")  # auto: write_back on cpu, else through
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
CACHE_REPORT_GRANULARITIES = ("exact", "page", "none")  # cached_tokens as non-admin keys see it


@dataclass(slots=True)
class ServerArgs:
    """Runtime settings; flag names follow SGLang's (``--max-total-tokens`` <-> ``max_total_tokens``)."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"  # "auto": cuda when a GPU is visible, else cpu
    attention_backend: str = "auto"  # "auto": flashinfer (else triton) on cuda, torch_native on cpu
    max_total_tokens: int | None = None
    # Share of memory for weights + KV pool: of free RAM on cpu (default 0.2), of the GPU's total memory on
    # cuda (default 0.85), as SGLang sizes it.
    mem_fraction_static: float | None = None
    max_running_requests: int = 128
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 8192
    page_size: int = 1
    context_length: int | None = None
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"
    max_pinned_ratio: float = 0.5  # share of the device KV pool that TTL pins (cache_control) may hold
    # KV memory hierarchy (SGLang's names): a host tier behind the device pool, a persistent disk tier.
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pool tokens = ratio x device pool tokens
    hicache_size: float = 0.0  # host pool GB; overrides the ratio when > 0
    hicache_write_policy: str = "auto"
    hicache_storage_dir: str | None = None  # the disk tier's directory (needs the hierarchical cache)
    hicache_storage_size: float = 16.0  # the disk tier's capacity, GB
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), fp8_e5m2, fp8_e4m3 (per-head scales)
    random_seed: int = 0
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    api_key_file: str | None = None  # a file holding the API key (keeps it off the command line)
    max_request_bytes: int = 16 * 2**20  # a larger request body is refused (413) before it is read whole
    log_level: str = "info"
    served_model_name: str | None = None
    disable_jump_forward: bool = False
    json_whitespace: bool = False
    grammar_compile_timeout: float = 30.0  # seconds, from the moment a thread starts compiling
    # Grammar limits: compiled grammars cached LRU by bytes; a constraint (regex / json_schema / ebnf
    # text) above max_grammar_bytes is a 400; a client (tenant, else everyone) with
    # max_grammar_compiles_per_client compilations queued or running gets a 429 for a new one.
    grammar_cache_size_mb: float = 256.0
    max_grammar_bytes: int = 262144
    grammar_compile_threads: int = 2
    max_grammar_compiles_per_client: int = 4
    # Admission control: the worker's waiting queue holds at most this many requests (each of n counts);
    # beyond it a request is refused with HTTP 429 and Retry-After. SGLang's name; 0 = unbounded.
    max_queued_requests: int = 4096
    max_batch_size: int = 1024  # most prompts in one /generate or /v1/completions batch (400 beyond)
    request_timeout: float | None = None  # seconds from arrival; longer requests fail with 504 (None: off)
    quantization: str | None = None
    disable_compile: bool = False
    compile_max_bs: int = 16
    # CUDA graphs of the decode step per batch-size bucket (SGLang's names); cuda only.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 64
    # Multi-tenancy: a JSON file of tenants (radixrt/config/tenants.py documents the schema).
    tenants: str | None = None
    cache_report_granularity: str = "exact"  # page: whole 16-token pages; none: 0 (non-admin keys)
    # Tensor parallelism on torch.distributed (SGLang's names): gloo on cpu, NCCL on cuda.
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of rank 0's rendezvous (default: a free local port)
    # Speculative decoding (SGLang's names): n-gram / prompt-lookup drafts, no draft model.
    speculative_algorithm: str | None = None  # "NGRAM" or None (off)
    speculative_num_draft_tokens: int = 4  # max draft tokens per request per step
    speculative_ngram_max_match_window_size: int = 3  # match the last n..1 tokens, longest first
    # Data parallelism (SGLang's names): `--dp-size N` serves N servers behind sglang-router.
    dp_size: int = 1
    router_policy: str = "cache_aware"
    router_dp_worker_base_port: int | None = None  # the first server's port (default: --port + 1)
    # Worker supervision: restarts of a dead worker allowed within the window (seconds), then give up.
    max_worker_restarts: int = 3
    worker_restart_window: float = 600.0
    # SIGTERM: seconds running requests get to finish (8: the rest is answered before `docker stop`'s 10 s)
    graceful_shutdown_timeout: float = 8.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy: {self.schedule_policy!r} not in {SCHEDULE_POLICIES}")
        if self.radix_eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"radix_eviction_policy: {self.radix_eviction_policy!r} not in {EVICTION_POLICIES}"
            )
        if self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} not in {KV_CACHE_DTYPES}")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy: {self.hicache_write_policy!r} not in {HICACHE_WRITE_POLICIES}"
            )
        if not 0 <= self.max_pinned_ratio < 1:
            raise ValueError(f"max_pinned_ratio: must be in [0, 1), got {self.max_pinned_ratio}")
        if self.hicache_ratio < 0 or self.hicache_size < 0 or self.hicache_storage_size <= 0:
            raise ValueError("hicache_ratio and hicache_size must be >= 0, hicache_storage_size > 0")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache: needs the radix cache (drop --disable-radix-cache)")
        if self.hicache_storage_dir is not None and not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_dir: needs --enable-hierarchical-cache")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout: must be > 0 seconds, got {self.grammar_compile_timeout}"
            )
        if not self.grammar_cache_size_mb >= 0:
            raise ValueError(f"grammar_cache_size_mb: must be >= 0, got {self.grammar_cache_size_mb}")
        for name in ("max_grammar_bytes", "grammar_compile_threads", "max_grammar_compiles_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(
                f"max_queued_requests: must be >= 0 (0: unbounded), got {self.max_queued_requests}"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {self.max_batch_size}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout: must be > 0 seconds, got {self.request_timeout}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests: must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(
                f"chunked_prefill_size: must be > 0 or -1 (off), got {self.chunked_prefill_size}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"max_total_tokens: {self.max_total_tokens} is too small")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization: {self.quantization!r} not in {QUANTIZATION_CHOICES}")
        if self.compile_max_bs < 1:
            raise ValueError(f"compile_max_bs: must be >= 1, got {self.compile_max_bs}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device: {self.device!r} not in {DEVICES} (or cuda:N)")
        if self.tp_size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"nnodes: {self.nnodes} must be >= 1 and divide tp_size {self.tp_size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: {self.node_rank} not in [0, nnodes={self.nnodes})")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs: must be >= 1, got {self.cuda_graph_max_bs}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static: must be in (0, 1], got {self.mem_fraction_static}")
        if self.speculative_algorithm not in (None, "NGRAM"):
            raise ValueError(f"speculative_algorithm: {self.speculative_algorithm!r} not in (None, 'NGRAM')")
        if self.cache_report_granularity not in CACHE_REPORT_GRANULARITIES:
            raise ValueError(
                f"cache_report_granularity: {self.cache_report_granularity!r} not in {CACHE_REPORT_GRANULARITIES}"
            )
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes: must be >= 1024, got {self.max_request_bytes}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size: must be >= 1, got {self.dp_size}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy: {self.router_policy!r} not in {ROUTER_POLICIES}")
        if self.max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts: must be >= 0, got {self.max_worker_restarts}")
        if self.worker_restart_window <= 0:
            raise ValueError(f"worker_restart_window: must be > 0, got {self.worker_restart_window}")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError(f"graceful_shutdown_timeout: must be >= 0, got {self.graceful_shutdown_timeout}")
        if self.speculative_num_draft_tokens < 1:
            raise ValueError(
                f"speculative_num_draft_tokens: must be >= 1, got {self.speculative_num_draft_tokens}"
            )
        if self.speculative_ngram_max_match_window_size < 1:
            raise ValueError(
                "speculative_ngram_max_match_window_size: must be >= 1, "
                f"got {self.speculative_ngram_max_match_window_size}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments, naming any unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag-name`` per field."""
        for f in fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else None
            if f.type in ("bool",):
                parser.add_argument(flag, action="store_true", default=default)
                continue
            kind: Any = {"int": int, "float": float, "int | None": int, "float | None": float}.get(
                str(f.type), str
            )
            choices: tuple[str, ...] | None = None
            if f.name == "schedule_policy":
                choices = SCHEDULE_POLICIES
            elif f.name == "radix_eviction_policy":
                choices = EVICTION_POLICIES
            elif f.name == "quantization":
                choices = QUANTIZATION_CHOICES
            elif f.name == "router_policy":
                choices = ROUTER_POLICIES
            elif f.name == "cache_report_granularity":
                choices = CACHE_REPORT_GRANULARITIES
            elif f.name == "kv_cache_dtype":
                choices = KV_CACHE_DTYPES
            elif f.name == "hicache_write_policy":
                choices = HICACHE_WRITE_POLICIES
            parser.add_argument(flag, type=kind, default=default, choices=choices)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
