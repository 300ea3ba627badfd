"""The cross-field and range checks of `ServerArgs` (``ServerArgs.validate`` runs them at construction):
each raises ValueError naming the first bad field; choices come from each field's metadata."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from radixrt.config.speculative_args import check_speculative

if TYPE_CHECKING:
    from radixrt.config.server_args import ServerArgs

DEVICES = ("auto", "cpu", "cuda")
# Fields whose only check is a lower bound: name -> (smallest allowed value, what the bound means).
AT_LEAST: dict[str, tuple[float, str]] = {
    "page_size": (1, ""),
    "max_grammar_bytes": (1, ""),
    "grammar_compile_threads": (1, ""),
    "max_grammar_compiles_per_client": (1, ""),
    "grammar_cache_size_mb": (0, ""),
    "max_queued_requests": (0, " (0: unbounded)"),
    "max_batch_size": (1, ""),
    "max_running_requests": (1, ""),
    "compile_max_bs": (1, ""),
    "dense_gemm_min_tokens": (0, " (0: off)"),
    "tp_size": (1, ""),
    "cuda_graph_max_bs": (1, ""),
    "max_request_bytes": (1024, ""),
    "dp_size": (1, ""),
    "max_worker_restarts": (0, ""),
    "graceful_shutdown_timeout": (0, ""),
    "log_interval": (0, " seconds (0: off)"),
}


def check_server_args(a: ServerArgs) -> None:
    """Raise ValueError naming the first bad setting of ``a``."""
    for f in fields(a):
        choices, value = f.metadata.get("choices"), getattr(a, f.name)
        if choices is not None and value is not None and value not in choices:
            raise ValueError(f"{f.name}: {value!r} not in {choices}")
    for name, (low, meaning) in AT_LEAST.items():
        value = getattr(a, name)
        if value is not None and not value >= low:  # None: unset, resolved later
            raise ValueError(f"{name}: must be >= {low}{meaning}, got {value}")
    _check_cache(a)
    _check_serving(a)
    _check_parallel(a)
    check_speculative(a)


def _check_cache(a: ServerArgs) -> None:
    if not 0 <= a.max_pinned_ratio < 1:
        raise ValueError(f"max_pinned_ratio: must be in [0, 1), got {a.max_pinned_ratio}")
    if a.hicache_ratio < 0 or a.hicache_size < 0 or a.hicache_storage_size <= 0:
        raise ValueError("hicache_ratio and hicache_size must be >= 0, hicache_storage_size > 0")
    if a.enable_hierarchical_cache and a.disable_radix_cache:
        raise ValueError("enable_hierarchical_cache: needs the radix cache (drop --disable-radix-cache)")
    if a.hicache_storage_dir is not None and not a.enable_hierarchical_cache:
        raise ValueError("hicache_storage_dir: needs --enable-hierarchical-cache")
    if a.strip_thinking_cache and a.reasoning_parser is None:
        raise ValueError("strip_thinking_cache: needs --reasoning-parser (which outputs reason)")
    if a.max_total_tokens is not None and a.max_total_tokens < 2 * a.page_size:
        raise ValueError(f"max_total_tokens: {a.max_total_tokens} is too small")
    if a.mem_fraction_static is not None and not 0 < a.mem_fraction_static <= 1:
        raise ValueError(f"mem_fraction_static: must be in (0, 1], got {a.mem_fraction_static}")
    if not 0 < a.swa_full_tokens_ratio <= 1:
        raise ValueError(f"swa_full_tokens_ratio: must be in (0, 1], got {a.swa_full_tokens_ratio}")
    if a.enable_swa_cache:
        _check_swa(a)


def _check_swa(a: ServerArgs) -> None:
    """What the sliding-window cache does not combine with (one local-K/V slot space on the device only)."""
    refused = {
        "--enable-hierarchical-cache (the host and disk tiers move whole-model K/V)": a.enable_hierarchical_cache,
        "--kv-cache-dtype fp8_* (one pool of unscaled K/V per layer group)": a.kv_cache_dtype != "auto",
        "--speculative-algorithm (rejected drafts would give back freed windows)": a.speculative_algorithm
        is not None,
        "--disaggregation-mode / --pd (the transfer moves whole-model K/V)": a.disaggregation_mode != "null"
        or a.pd,
        "--tenants (reserved shares cover the global layers' pool only)": a.tenants is not None,
        "--tp-size > 1": a.tp_size > 1,
    }
    for what, on in refused.items():
        if on:
            raise ValueError(f"enable_swa_cache: not supported with {what}")


def _check_serving(a: ServerArgs) -> None:
    if not a.grammar_compile_timeout > 0:
        raise ValueError(f"grammar_compile_timeout: must be > 0 seconds, got {a.grammar_compile_timeout}")
    if a.responses_store_max_items < 1 or a.responses_store_ttl_s <= 0:
        raise ValueError("responses_store_max_items: must be >= 1, and responses_store_ttl_s > 0")
    if a.request_timeout is not None and not a.request_timeout > 0:
        raise ValueError(f"request_timeout: must be > 0 seconds, got {a.request_timeout}")
    if a.chunked_prefill_size == 0 or a.chunked_prefill_size < -1:
        raise ValueError(f"chunked_prefill_size: must be > 0 or -1 (off), got {a.chunked_prefill_size}")
    if a.enable_mixed_chunk and a.speculative_algorithm is not None:
        raise ValueError("enable_mixed_chunk: not with --speculative-algorithm (verify steps are not mixed)")
    if a.enable_mixed_chunk and a.disaggregation_mode != "null":
        raise ValueError(
            "enable_mixed_chunk: not with --disaggregation-mode (a server there only prefills or decodes)"
        )
    if a.worker_restart_window <= 0:
        raise ValueError(f"worker_restart_window: must be > 0, got {a.worker_restart_window}")


def _check_parallel(a: ServerArgs) -> None:
    if a.device not in DEVICES and not a.device.startswith("cuda:"):
        raise ValueError(f"device: {a.device!r} not in {DEVICES} (or cuda:N)")
    if a.nnodes < 1 or a.tp_size % a.nnodes:
        raise ValueError(f"nnodes: {a.nnodes} must be >= 1 and divide tp_size {a.tp_size}")
    if not 0 <= a.node_rank < a.nnodes:
        raise ValueError(f"node_rank: {a.node_rank} not in [0, nnodes={a.nnodes})")
    if a.pd and (a.disaggregation_mode != "null" or a.dp_size > 1):
        raise ValueError("pd: starts both modes itself; drop --disaggregation-mode and --dp-size")
    if a.disaggregation_mode != "null" and a.tp_size > 1:
        raise ValueError("disaggregation_mode: not supported with --tp-size > 1 (one KV pool per server)")
    if not 0 < a.disaggregation_bootstrap_port < 65536 or not a.disaggregation_timeout > 0:
        raise ValueError("disaggregation_bootstrap_port: must be a port, and disaggregation_timeout > 0")
