"""ServerArgs: every runtime setting, shared by Engine, the server CLI and the worker.

Each field carries its ``--help`` text (`radixrt.config.flags.arg`): the one source of ``radixrt serve
--help`` and of docs/flags.md (``python -m radixrt.config.flags_doc > docs/flags.md``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from radixrt.config import flags
from radixrt.config.checks import check_server_args
from radixrt.config.flags import FlagSpec, arg

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
EVICTION_POLICIES = ("lru", "lfu", "priority")
# NOTE: the names below are spelled here so that parsing flags imports no torch; tests/test_cli.py checks
# that they match radixrt.layers.QUANTIZATION_CHOICES, radixrt.models.config's dtype names,
# radixrt.kernels.base's attention backends and radixrt.mem_cache.kv_pool.KV_CACHE_DTYPES.
QUANTIZATION_CHOICES = ("none", "int8", "int4", "gguf")
DTYPES = ("auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half")
ATTENTION_BACKENDS = ("auto", "torch_native", "flashinfer", "triton")
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3")
HICACHE_WRITE_POLICIES = ("auto", "write_back", "write_through")
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")  # sglang-router 0.3.2's --policy
CACHE_REPORT_GRANULARITIES = ("exact", "page", "none")
# radixrt.server.tool_parsers.registry's names (tests/test_tool_parsers.py checks that they match)
TOOL_CALL_PARSERS = ("qwen25", "llama3", "mistral", "pythonic")
REASONING_PARSERS = ("qwen3", "deepseek-r1")  # radixrt.server.reasoning_parser.FORMATS
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DISAGGREGATION_MODES = ("null", "prefill", "decode")  # SGLang's names
TRANSFER_BACKENDS = ("mooncake", "fake")
# The first field of each section of `radixrt serve --help` and docs/flags.md (a section's fields follow it).
SECTIONS = {
    "model_path": "Model",
    "max_total_tokens": "KV cache",
    "enable_hierarchical_cache": "Hierarchical KV cache (host and disk tiers)",
    "max_running_requests": "Scheduling and admission",
    "host": "HTTP server",
    "disable_jump_forward": "Constrained decoding",
    "disable_compile": "Decode compilation and CUDA graphs",
    "speculative_algorithm": "Speculative decoding",
    "tp_size": "Parallelism",
    "disaggregation_mode": "Prefill/decode disaggregation",
    "log_level": "Logging",
    "max_worker_restarts": "Supervision and shutdown",
}


@dataclass(slots=True)
class ServerArgs:
    """Runtime settings; flag names follow SGLang's (``--max-total-tokens`` <-> ``max_total_tokens``)."""

    # -- model ------------------------------------------------------------------------------------
    model_path: str | None = arg(
        None,
        "The checkpoint to serve: a Hugging Face model directory (config.json, tokenizer.json, safetensors), "
        "a .gguf file, or a directory holding one .gguf file (converted once into an HF directory under "
        "$RADIXRT_CACHE_DIR, default ~/.cache/radixrt), an embedded model's short name (smollm2, gemma3-270m), "
        "or a Hugging Face id: org/name, org/name:Q4_K_M (the repository's GGUF file of that quantization type) "
        "or org/name/file.gguf, fetched through the Hugging Face cache (HF_HUB_OFFLINE=1: from the cache only). "
        "Unset: the embedded SmolLM2-135M-Instruct.",
    )
    revision: str | None = arg(
        None, "Branch, tag or commit of a Hugging Face id in --model-path. Unset: main."
    )
    tokenizer_path: str | None = arg(
        None, "Directory of the tokenizer (tokenizer.json, tokenizer_config.json). Unset: the model's."
    )
    served_model_name: str | None = arg(
        None,
        "The model name /v1/models and /model_info report; when set, an OpenAI request naming another "
        "model gets 404 model_not_found. Unset: the checkpoint's directory or GGUF file name, and a request "
        "may name any model.",
    )
    dtype: str = arg(
        "auto",
        "Dtype of weights and activations: float32 (fp32, float), bfloat16 (bf16), float16 (fp16, half). "
        "auto: bfloat16 on cuda; on cpu bfloat16 where the CPU has native bf16 (AVX512-BF16 or AMX), "
        "else float32.",
        DTYPES,
    )
    quantization: str | None = arg(
        None,
        "Weight-only quantization of the linear layers: int8 or int4 (quantized from the loaded float "
        "weights), gguf (the GGUF file's own quantized blocks; needs a GGUF checkpoint), none. Unset: gguf "
        "for a GGUF checkpoint, else none. With --tp-size > 1 only none.",
        QUANTIZATION_CHOICES,
    )
    dense_gemm_min_tokens: int | None = arg(
        None,
        "Quantized linears (int8, int4, gguf) also keep their weights dequantized to --dtype (+257 MiB in "
        "bf16 for the embedded model) and multiply a batch of at least this many tokens (prefill, extend, "
        "large decode batches) by them with a dense GEMM; smaller batches keep the quantized kernel. Unset: "
        "16 in bf16 on a CPU with AMX where the int4 kernel cannot use the tiles, else 32. 0: never.",
    )
    dense_gemm_int8: bool = arg(
        False,
        "The large batches of --dense-gemm-min-tokens multiply in int8 instead of --dtype: the quantized "
        "linears keep their weights requantized to int8 per output channel (1 byte a weight, instead of the "
        "dense copy's 2 in bf16) and round each token's activations to int8 (per-token absmax) at run time "
        "(torch._int_mm, VNNI): on the embedded model prefill 1.33x and extend 1.13x faster, perplexity +3.6% "
        "instead of +0.1% (docs/cpu.md); off: the dense copy, whose products equal the dequantized weight's.",
    )
    int4_kernel: str = arg(
        "auto",
        "Kernel of the int4 weight-only linears (int4, gguf's 4/5/8-bit blocks) for batches below "
        "--dense-gemm-min-tokens: auto (radixrt's own, built on first use: AVX512-BF16 in bf16, AVX2 in float32, "
        "where int8 linears use it too and gguf becomes the default for a GGUF file; +0.5 byte a weight), q8 "
        "(auto, with float32 activations rounded to int8 per 32-column group for the 4-bit codes, as llama.cpp "
        "does: faster, not exact; docs/cpu.md), torch (torch's kernels; float32 then runs a GGUF file dense).",
        ("auto", "q8", "torch"),
    )
    context_length: int | None = arg(
        None,
        "Longest sequence (prompt + generated tokens) a request may reach; a request whose prompt + "
        "max_new_tokens exceeds it is refused (400). Unset, or above the model's max_position_embeddings: "
        "the model's.",
    )
    device: str = arg(
        "auto", "Where the worker runs: cpu, cuda or cuda:N; auto: cuda when torch sees a GPU, else cpu."
    )
    attention_backend: str = arg(
        "auto",
        "Attention kernels: torch_native (any device), flashinfer or triton (cuda). auto: flashinfer on "
        "cuda when it is installed, else triton; torch_native on cpu.",
        ATTENTION_BACKENDS,
    )
    random_seed: int = arg(
        0,
        "Seeds torch in the worker and the server's draws of per-request sampling seeds (a request's "
        "sampling_params.seed takes precedence).",
    )
    # -- KV cache -----------------------------------------------------------------------------------
    max_total_tokens: int | None = arg(
        None, "Size of the KV pool in tokens. Unset: sized from memory by --mem-fraction-static."
    )
    mem_fraction_static: float | None = arg(
        None,
        "Without --max-total-tokens, the share of memory that sizes the KV pool, in (0, 1]: on cuda, of the "
        "GPU's total memory, for weights + KV pool (unset: 0.85, as SGLang); on cpu, of the RAM free after "
        "loading the weights, for the KV pool alone (unset: 0.2). The pool holds at least 4 x the context "
        "length and at most 4194304 tokens.",
    )
    page_size: int = arg(
        1,
        "Tokens per KV page: the pool, the radix cache and its tiers allocate, match and evict whole pages.",
    )
    kv_cache_dtype: str = arg(
        "auto",
        "Storage dtype of the KV pool: auto (the model's dtype), fp8_e5m2, or fp8_e4m3 (with per-head "
        "power-of-two scales and centred keys, calibrated at start). float8 halves (bf16) or quarters (fp32) "
        "KV memory; the CPU attention kernels read it in place.",
        KV_CACHE_DTYPES,
    )
    disable_radix_cache: bool = arg(False, "Disable prefix caching: no request reuses another's KV.")
    radix_eviction_policy: str = arg(
        "lru",
        "Which cached prefixes go first when the KV pool is full: lru (least recently used), lfu (least "
        "frequently used), priority (lower request priority first, then least recently used).",
        EVICTION_POLICIES,
    )
    max_pinned_ratio: float = arg(
        0.5,
        "Share of the device KV pool, in [0, 1), that TTL pins (a request's cache_control, /pin_prefix) "
        "may hold; a pin that does not fit pins the longest page-aligned prefix that does.",
    )
    enable_swa_cache: bool = arg(
        False,
        "Sliding-window-aware KV cache for models with interleaved local and global attention layers "
        "(Gemma 3): the local layers' K/V live in a pool of their own and are freed once out of every window "
        "while the global layers keep the whole prefix; a cached prefix is reused when its last window's "
        "local K/V is still there (docs/cache.md). cpu only; not with the hierarchical cache, fp8 KV, "
        "speculative decoding, disaggregation, tenants or tensor parallelism.",
    )
    swa_full_tokens_ratio: float = arg(
        0.25,
        "With --enable-swa-cache, the local layers' pool in tokens as a share, in (0, 1], of the global "
        "layers' pool (--max-total-tokens, or what the memory budget sizes at this ratio).",
    )
    # -- hierarchical KV cache (SGLang's names) -----------------------------------------------------
    enable_hierarchical_cache: bool = arg(
        False,
        "Keep KV evicted from the device pool in a host-memory tier and load it back for a later match "
        "instead of recomputing it (needs the radix cache).",
    )
    hicache_ratio: float = arg(2.0, "Host tier size as a multiple of the device pool's tokens.")
    hicache_size: float = arg(0.0, "Host tier size in GiB; when > 0 it overrides --hicache-ratio.")
    hicache_write_policy: str = arg(
        "auto",
        "When KV is copied to the host tier: write_back (at device eviction), write_through (at insert; "
        "the copy is kept). auto: write_through on cuda, write_back on cpu.",
        HICACHE_WRITE_POLICIES,
    )
    hicache_storage_dir: str | None = arg(
        None,
        "Directory of the persistent disk tier (needs --enable-hierarchical-cache): whole chunks of cached "
        "prefixes are written there in the background and read back at admission, after a restart too. "
        "Unset: no disk tier.",
    )
    hicache_storage_size: float = arg(
        16.0, "Capacity of the disk tier in GiB; the least recently used files are removed beyond it."
    )
    # -- scheduling and admission -------------------------------------------------------------------
    max_running_requests: int = arg(128, "Most requests in the running (decoding) batch at once.")
    chunked_prefill_size: int = arg(
        2048,
        "Most prompt tokens one prefill forward computes; a longer prompt is prefilled in chunks over "
        "several steps. -1: --max-prefill-tokens is that budget instead.",
    )
    max_prefill_tokens: int = arg(
        8192, "The prefill budget of one forward when --chunked-prefill-size is -1."
    )
    enable_mixed_chunk: bool = arg(
        False,
        "Run the running requests' decode tokens inside a prefill forward (SGLang's name) instead of pausing "
        "them for it: the weights are read once for both. Not with speculative decoding or disaggregation.",
    )
    schedule_policy: str = arg(
        "lpm",
        "Order in which waiting requests are admitted: lpm (longest cached prefix first), dfs-weight "
        "(depth-first over the radix tree, subtrees with more waiting requests first), fcfs (arrival "
        "order). lpm and dfs-weight act as fcfs beyond 256 waiting requests or without the radix cache.",
        SCHEDULE_POLICIES,
    )
    max_queued_requests: int = arg(
        4096,
        "Most requests waiting in the worker's queue (each of n counts); beyond it a request gets 429 with "
        "Retry-After. 0: unbounded.",
    )
    request_timeout: float | None = arg(
        None,
        "Seconds from arrival after which a queued or running request is aborted with 504 (its KV freed). "
        "Unset: no limit.",
    )
    # -- HTTP server ----------------------------------------------------------------------------------
    host: str = arg("127.0.0.1", "Address the HTTP server binds (0.0.0.0: every interface).")
    port: int = arg(30000, "Port of the HTTP server (with --dp-size > 1: of the router in front).")
    api_key: str | None = arg(
        None,
        "Admin key: every route but /health then needs `Authorization: Bearer KEY`. Every local user sees "
        "it in ps; --api-key-file or $RADIXRT_API_KEY keep it off the command line.",
    )
    api_key_file: str | None = arg(None, "A file holding the admin key (instead of --api-key).")
    max_request_bytes: int = arg(
        16 * 2**20, "Largest request body; a larger one gets 413 before it is read whole (>= 1024)."
    )
    max_batch_size: int = arg(
        1024, "Most prompts in one /generate or /v1/completions batch; a larger batch gets 400."
    )
    tenants: str | None = arg(
        None,
        "A JSON file of tenants (name, api_keys, kv_quota, priority, reserved): each tenant gets its own "
        "cache namespace, a KV quota and fair admission. Needs --api-key (the admin key).",
    )
    cache_report_granularity: str = arg(
        "exact",
        "What a non-admin key sees as cached_tokens: exact, page (rounded down to whole 16-token pages) or "
        "none (always 0); the coarser, the less a tenant learns about what other tenants cached.",
        CACHE_REPORT_GRANULARITIES,
    )
    tool_call_parser: str | None = arg(
        None,
        "How /v1/chat/completions reads tool calls from the output: qwen25 (Hermes / Qwen2.5 <tool_call>{json}"
        '</tool_call>), llama3 (JSON {"name", "parameters"}), mistral ([TOOL_CALLS] [...]), pythonic '
        "([f(a=1)]). Unset: the format the chat template writes, else qwen25 (with the generic tool prompt "
        "for a template without tools).",
        TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = arg(
        None,
        "Split <think>...</think> reasoning off /v1/chat/completions answers into message.reasoning_content "
        "(streamed: delta.reasoning_content): qwen3 (reasoning when the output opens <think>, or the prompt "
        "ends with it), deepseek-r1 (the output is reasoning up to </think>, opening tag or not). Requests "
        "turn it off with separate_reasoning: false. Unset: the text is all content.",
        REASONING_PARSERS,
    )
    strip_thinking_cache: bool = arg(
        False,
        "With --reasoning-parser: a finished /v1/chat/completions request whose output reasoned is cached up "
        "to its prompt only (SGLang's flag): chat templates drop earlier turns' reasoning, so its output's KV "
        "(reasoning and the answer after it) would never be matched again and is freed at once.",
    )
    is_embedding: bool = arg(
        False,
        "Serve /v1/embeddings with a decoder-based embedding model (SGLang's flag): each input's final hidden "
        "states pooled (last token, or mean as the checkpoint's 1_Pooling/config.json says) and L2-normalized.",
    )
    responses_store_max_items: int = arg(
        1000,
        "Most responses /v1/responses keeps for GET, DELETE and previous_response_id (stored with store=true, "
        "the default); beyond it the oldest go.",
    )
    responses_store_ttl_s: float = arg(
        3600.0, "Seconds a stored /v1/responses response stays readable and continuable (then it expires)."
    )
    # -- constrained decoding ---------------------------------------------------------------------------
    disable_jump_forward: bool = arg(
        False,
        "Sample every token of a constrained request, even where the grammar allows only one (by default "
        "those are appended without sampling and computed in one extend).",
    )
    json_whitespace: bool = arg(
        False, "JSON-schema output may hold up to two whitespace characters where JSON allows (else compact)."
    )
    grammar_compile_timeout: float = arg(
        30.0, "Seconds a grammar may compile, from the moment a thread starts it; then the request gets 400."
    )
    grammar_cache_size_mb: float = arg(256.0, "Memory (MiB) of the LRU cache of compiled grammars.")
    max_grammar_bytes: int = arg(
        262144, "Largest constraint (regex, json_schema or ebnf text) in bytes; a larger one gets 400."
    )
    grammar_compile_threads: int = arg(2, "Threads that compile grammars.")
    max_grammar_compiles_per_client: int = arg(
        4,
        "Most grammar compilations one client (its tenant, else everyone) may have queued or running; "
        "another one gets 429.",
    )
    # -- decode compilation and CUDA graphs (SGLang's names for the graphs) ---------------------------
    disable_compile: bool = arg(
        False, "cpu: run decode eagerly instead of through torch.compile'd graphs per batch-size bucket."
    )
    compile_max_bs: int = arg(
        16,
        "cpu: largest compiled decode bucket (buckets 1, 2, 4, ... up to it); a larger batch decodes eagerly. "
        "With speculation, buckets of full verifies are added (b x (1 + draft tokens) for b = 1, 2, 4, ... up "
        "to --speculative-max-batch-size).",
    )
    compile_scope: str = arg(
        "layer",
        "cpu: what one compiled decode graph covers. layer: one decoder layer, shared by the layers alike "
        "(fast to compile: ~25 s cold, ~3 s warm for the embedded model's 5 buckets); model: the whole stack "
        "of layers per bucket, one call a step (the embedded model's bare batch-1 step 10-14% faster, batch-1 "
        "decode end to end ~5%, 16 streams unchanged; ~110 s cold and ~20-25 s warm to compile).",
        ("layer", "model"),
    )
    disable_cuda_graph: bool = arg(False, "cuda: decode without CUDA graphs.")
    cuda_graph_max_bs: int = arg(
        64,
        "cuda: largest captured decode bucket (1, 2, 4, ... up to it); a larger batch runs without graphs.",
    )
    # -- speculative decoding (SGLang's names) ----------------------------------------------------------
    speculative_algorithm: str | None = arg(
        None,
        "NGRAM: draft tokens by n-gram lookup in the request's own prompt and output (no draft model) and "
        "verify them in one forward; SUFFIX: suffix decoding, drafts of adaptive length from suffix tries over "
        "the request's own tokens and the finished requests of its cache namespace. Requests with a grammar "
        "or logprobs are not drafted. Unset: off.",
        ("NGRAM", "SUFFIX"),
    )
    speculative_num_draft_tokens: int | None = arg(
        None, "Most draft tokens per request per step (unset: 4; SUFFIX 8)."
    )
    speculative_ngram_max_match_window_size: int = arg(
        3, "Longest suffix (in tokens) the n-gram lookup matches; it tries n down to 1, longest first."
    )
    speculative_max_batch_size: int = arg(
        8,
        "Most running requests a speculative step drafts for; with more, every step decodes plainly. The "
        "compiled decode buckets grow to hold a verify of this many requests' full drafts.",
    )
    speculative_verify_cost: float | None = arg(
        None,
        "A verify step's time in plain decode steps, whatever it holds: a step then verifies all its drafts "
        "when B + their expected accepted tokens reach cost x B (1: verify every draft). Unset: measured, "
        "from the compiled decode step's time per bucket and per attention work (2 off the compiled path).",
    )
    speculative_suffix_max_depth: int = arg(
        24, "SUFFIX: depth of the suffix tries (longest matched suffix plus draft, in tokens)."
    )
    speculative_suffix_min_prob: float = arg(
        0.1,
        "SUFFIX: a draft grows while the product of its tokens' empirical continuation probabilities is "
        "at least this.",
    )
    speculative_suffix_prompt_window: int = arg(
        512,
        "SUFFIX: the last this many prompt tokens enter the request's own trie (indexing costs depth dict "
        "operations a token: ~25 ms for 1.7k tokens); what came before is drafted from the global index only.",
    )
    speculative_suffix_cache_tokens: int = arg(
        65536,
        "SUFFIX: tokens of finished requests (prompt + output) the global index holds, LRU; up to depth nodes each.",
    )
    # -- parallelism (SGLang's names) -------------------------------------------------------------------
    tp_size: int = arg(
        1, "Tensor-parallel ranks (torch.distributed: gloo on cpu, NCCL on cuda); decode then runs eagerly."
    )
    nnodes: int = arg(1, "Nodes the tensor-parallel ranks span (must divide --tp-size).")
    node_rank: int = arg(
        0,
        "This node's index among --nnodes: node 0 serves HTTP; the others run only their tensor-parallel "
        "ranks, in the foreground, until rank 0 stops them.",
    )
    dist_init_addr: str | None = arg(
        None,
        "HOST:PORT of rank 0's rendezvous (the same on every node; needed with --nnodes > 1). Unset: a free "
        "local port.",
    )
    dp_size: int = arg(
        1,
        "Data-parallel servers: N > 1 starts N servers on consecutive ports behind sglang-router on --port "
        "(pip install sglang-router).",
    )
    router_policy: str = arg("cache_aware", "With --dp-size > 1: sglang-router's --policy.", ROUTER_POLICIES)
    router_dp_worker_base_port: int | None = arg(
        None, "With --dp-size > 1: the first server's port (the others follow). Unset: --port + 1."
    )
    # -- prefill/decode disaggregation ------------------------------------------------------------------
    disaggregation_mode: str = arg(
        "null",
        "prefill: this server computes prompts and writes their KV into a decode server's pool; decode: it "
        "receives requests with their prompt's KV and generates; null: both (a normal server). Requests come "
        "through sglang-router --pd-disaggregation, which sends each one to a prefill and a decode server "
        "with the same bootstrap_room (docs/pd.md).",
        DISAGGREGATION_MODES,
    )
    disaggregation_transfer_backend: str = arg(
        "mooncake",
        "How the KV moves: mooncake (the Mooncake transfer engine, TCP or RDMA; pip install 'radixrt[pd]') or "
        "fake (the bytes travel inside the control messages over TCP: tests and machines without Mooncake).",
        TRANSFER_BACKENDS,
    )
    disaggregation_bootstrap_port: int = arg(
        8998, "With --disaggregation-mode prefill: the port of the bootstrap server decode servers ask."
    )
    disaggregation_ib_device: str | None = arg(
        None, "RDMA device(s) for the Mooncake transfer engine (mlx5_0,...). Unset: its TCP transport."
    )
    pd: bool = arg(
        False,
        "Start one prefill server (--port + 1), one decode server (--port + 2) and sglang-router in PD mode on "
        "--port, on this machine (docs/pd.md).",
    )
    disaggregation_timeout: float = arg(
        30.0,
        "Seconds a prefill server waits for the decode side's KV slots and a decode server waits for the KV "
        "before the request ends with 504 (its slots freed on both sides).",
    )
    # -- logging ----------------------------------------------------------------------------------------
    log_level: str = arg("info", "Level of the server's, the worker's and uvicorn's logs.", LOG_LEVELS)
    log_requests: bool = arg(
        False,
        "The HTTP server logs one line per finished request (at --log-level info): rid, tenant, prompt / "
        "cached / generated tokens, finish reason and latency; never prompt or output text.",
    )
    log_interval: float = arg(
        5.0,
        "Seconds between the worker's load lines while it is busy (at --log-level info): running and "
        "queued requests, KV usage, cache hit rate and prefill / decode tokens per second over the "
        "interval. 0: off.",
    )
    # -- supervision and shutdown -----------------------------------------------------------------------
    max_worker_restarts: int = arg(
        3,
        "Restarts of a dead worker allowed within --worker-restart-window; one more death and the server "
        "gives up and exits with code 1.",
    )
    worker_restart_window: float = arg(600.0, "Seconds over which --max-worker-restarts counts restarts.")
    graceful_shutdown_timeout: float = arg(
        8.0,
        "Seconds running requests get to finish after the first SIGTERM / SIGINT (new ones get 503); then "
        "they end with 503 (8: answered within docker stop's 10 s).",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting (`radixrt.config.checks`)."""
        check_server_args(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments, naming any unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @staticmethod
    def flag_specs() -> list[FlagSpec]:
        """Every flag: name, type, default, help, choices, section (`radixrt.config.flags`)."""
        return flags.flag_specs(ServerArgs, SECTIONS)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag-name`` per field, with its help, default and choices."""
        flags.add_flags(parser, ServerArgs.flag_specs())

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerArgs:
        """Build from the namespace of a parser that `add_cli_args` set up."""
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
