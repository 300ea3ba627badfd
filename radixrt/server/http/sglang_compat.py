"""SGLang request fields radixrt does not implement: accepted at their neutral value, refused otherwise.

SGLang's own clients fill in fields of SGLang's request types (sglang 0.5.x ``GenerateReqInput``, the
OpenAI ``CompletionRequest`` / ``ChatCompletionRequest``; sampling parameters) at their defaults:
sglang-router forwards ``model``, ``return_hidden_states: false``, ``separate_reasoning: true``, ...;
``sglang.bench_serving`` sends ``lora_path: null`` and ``return_routed_experts: false``. Each table maps
such a field to what radixrt accepts for it. ``strip_neutral`` removes them from a decoded JSON body
before the strict decode, so a field that asks for a behaviour radixrt lacks is a 400 naming it, and a
field SGLang does not define either stays "unrecognized request argument".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from radixrt.server.http.errors import APIError


class Neutral(NamedTuple):
    """Which values of an unimplemented field are accepted (``accepts``), spelled for the error."""

    accepts: Callable[[Any], bool]
    spelled: str


def _off(v: Any) -> bool:
    """null, false, "", [] and {} (and lists of them: a batch's per-prompt values)."""
    if v is None or v is False or v == "" or v == {}:
        return True
    return isinstance(v, list) and all(_off(x) for x in v)


def _zero(v: Any) -> bool:
    return _off(v) or (isinstance(v, int) and not isinstance(v, bool) and v == 0)


OFF = Neutral(_off, "null / false / empty")
ZERO = Neutral(_zero, "null / 0")  # a DP rank: this server is the only one, rank 0
BOOL = Neutral(lambda v: isinstance(v, bool), "true / false")  # output/parser switches without effect here
ANY = Neutral(lambda v: True, "any value")  # identity, tracing and metrics labels: no effect on the output
ONE = Neutral(lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 1), "null / 1")
NAME = Neutral(lambda v: v is None or isinstance(v, str), "a model name")

# Fields both SGLang OpenAI requests define.
_OPENAI_COMMON: dict[str, Neutral] = {
    "return_hidden_states": OFF, "return_routed_experts": OFF, "routed_experts_start_len": ZERO,
    "return_cached_tokens_details": OFF, "return_spec_tokens_details": OFF, "return_token_ids": OFF,
    "stop_regex": OFF, "lora_path": OFF, "session_id": ANY, "session_params": OFF, "custom_params": OFF,
    "custom_logit_processor": OFF, "watermark": OFF, "images_config": OFF, "mm_processor_kwargs": OFF,
    "extra_key": OFF, "custom_labels": ANY, "data_parallel_rank": ZERO,
    "routed_dp_rank": ZERO, "disagg_prefill_dp_rank": ZERO, "bootstrap_host": OFF, "bootstrap_port": OFF,
    "bootstrap_room": OFF,
}  # fmt: skip

# /v1/completions: SGLang's CompletionRequest fields that radixrt's CompletionRequest lacks.
COMPLETION_FIELDS: dict[str, Neutral] = dict(_OPENAI_COMMON)

# /v1/chat/completions: SGLang's ChatCompletionRequest fields that radixrt's lacks.
CHAT_FIELDS: dict[str, Neutral] = {
    **_OPENAI_COMMON,
    "return_prompt_token_ids": OFF, "return_meta_info": OFF, "return_input_ids_in_sglext": OFF,
    "return_output_ids_in_sglext": OFF, "return_sampling_mask": OFF, "sampling_logprobs_mode": OFF,
    "return_flat_raw_output_top_logprobs": OFF, "return_flat_raw_top_logprobs_b64": BOOL,
    "reasoning_effort": OFF, "thinking": OFF, "task": OFF, "continue_final_message": OFF,
    "max_dynamic_patch": OFF,
    "min_dynamic_patch": OFF, "use_audio_in_video": OFF, "video_config": OFF, "input_ids": OFF,
}  # fmt: skip

# POST /generate: SGLang's GenerateReqInput fields that radixrt's lacks, plus the router's ``model``.
GENERATE_FIELDS: dict[str, Neutral] = {
    "model": NAME, "session_id": ANY, "input_embeds": OFF, "image_data": OFF, "video_data": OFF,
    "audio_data": OFF, "mm_hashes": OFF, "mm_content_hashes": OFF, "use_audio_in_video": OFF,
    "video_config": OFF, "watermark": OFF, "token_ids_logprob": OFF, "return_sampling_mask": OFF,
    "sampling_logprobs_mode": OFF, "return_flat_raw_top_logprobs": OFF,
    "return_flat_raw_output_top_logprobs": OFF, "return_flat_raw_top_logprobs_b64": OFF,
    "log_metrics": BOOL, "return_hidden_states": OFF, "return_routed_experts": OFF,
    "routed_experts_start_len": ZERO, "return_indexer_topk": OFF, "modalities": OFF,
    "session_params": OFF, "lora_path": OFF, "lora_id": OFF, "custom_logit_processor": OFF,
    "positional_embed_overrides": OFF, "bootstrap_host": OFF, "bootstrap_port": OFF,
    "bootstrap_room": OFF, "bootstrap_pair_key": OFF, "decode_tp_size": OFF, "routed_dp_rank": ZERO,
    "data_parallel_rank": ZERO, "disagg_prefill_dp_rank": ZERO, "routing_key": ANY,
    "conversation_id": ANY, "http_worker_ipc": OFF, "background": OFF, "require_reasoning": OFF,
    "max_thinking_tokens": OFF, "extra_key": OFF, "no_logs": BOOL,
    "custom_labels": ANY, "return_bytes": OFF, "return_entropy": OFF, "return_prompt_token_ids": OFF,
    "external_trace_header": ANY, "received_time": ANY, "need_wait_for_mm_inputs": OFF,
    "num_items_assigned": OFF, "encoder_urls": OFF, "max_dynamic_patch": OFF, "min_dynamic_patch": OFF,
    "image_max_dynamic_patch": OFF, "video_max_dynamic_patch": OFF, "images_config": OFF,
    "mm_processor_kwargs": OFF, "multi_item_delimiter_indices": OFF, "token_indices_to_pool": OFF,
    "kv_hints": OFF,
}  # fmt: skip

# Keys of /generate's ``sampling_params``: SGLang's SamplingParams fields that radixrt's lacks.
SAMPLING_FIELDS: dict[str, Neutral] = {
    "stop_regex": OFF, "custom_params": OFF, "logit_bias": OFF, "structural_tag": OFF,
    "stream_interval": OFF, "watermark": OFF, "beam_width": ONE,
}  # fmt: skip


def strip_neutral(body: dict[str, Any], table: dict[str, Neutral]) -> None:
    """Remove ``table``'s fields from ``body``; 400 naming the first one that is not neutral."""
    for name in [k for k in body if k in table]:
        value = body.pop(name)
        rule = table[name]
        if not rule.accepts(value):
            raise APIError(
                400, f"{name}: not supported by this server (accepted only as {rule.spelled})", param=name
            )


def normalize_generate(body: dict[str, Any]) -> None:
    """A /generate body in SGLang's shape -> radixrt's: neutral fields dropped, JSON nulls meaning
    "default" dropped (SGLang's ``return_logprob`` is optional), ``sampling_seed`` named ``seed``."""
    strip_neutral(body, GENERATE_FIELDS)
    for name in [k for k, v in body.items() if v is None]:
        del body[name]
    params = body.get("sampling_params")
    for item in params if isinstance(params, list) else [params]:
        if isinstance(item, dict):
            strip_neutral(item, SAMPLING_FIELDS)
            if "sampling_seed" in item:
                seed = item.pop("sampling_seed")
                if "seed" not in item or item["seed"] is None:
                    item["seed"] = seed
