"""Write a GGUF file from an HF checkpoint directory, the way llama.cpp's converter lays it out.

For tests and benchmarks: the `gguf` package's writer does the file format; this module supplies what
llama.cpp's `convert_hf_to_gguf.py` would (metadata keys, tensor names, the Q/K row permutation of
Llama-architecture attention weights, the byte-level BPE vocabulary, experts stacked into one
``[E, out, in]`` tensor per projection, Phi-3's fused ``attn_qkv`` / ``ffn_up`` and LongRoPE factors). Only
checkpoints with a byte-level BPE `tokenizer.json` (what `make_checkpoint` writes) are handled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

# HF module (without ".weight"/".bias") -> GGUF base name; "{i}" is the layer index.
_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "model.layers.{i}.self_attn.q_proj": "blk.{i}.attn_q",
    "model.layers.{i}.self_attn.k_proj": "blk.{i}.attn_k",
    "model.layers.{i}.self_attn.v_proj": "blk.{i}.attn_v",
    "model.layers.{i}.self_attn.o_proj": "blk.{i}.attn_output",
    "model.layers.{i}.self_attn.q_norm": "blk.{i}.attn_q_norm",
    "model.layers.{i}.self_attn.k_norm": "blk.{i}.attn_k_norm",
    "model.layers.{i}.mlp.gate_proj": "blk.{i}.ffn_gate",
    "model.layers.{i}.mlp.up_proj": "blk.{i}.ffn_up",
    "model.layers.{i}.mlp.down_proj": "blk.{i}.ffn_down",
    "model.layers.{i}.input_layernorm": "blk.{i}.attn_norm",
    "model.layers.{i}.post_attention_layernorm": "blk.{i}.ffn_norm",
    "model.layers.{i}.self_attn.qkv_proj": "blk.{i}.attn_qkv",  # Phi-3
    "model.layers.{i}.mlp.gate_up_proj": "blk.{i}.ffn_up",  # Phi-3: [gate; up] rows
    "model.layers.{i}.mlp.gate": "blk.{i}.ffn_gate_inp",  # the router
    "model.layers.{i}.mlp.experts.gate_proj": "blk.{i}.ffn_gate_exps",
    "model.layers.{i}.mlp.experts.up_proj": "blk.{i}.ffn_up_exps",
    "model.layers.{i}.mlp.experts.down_proj": "blk.{i}.ffn_down_exps",
    "model.layers.{i}.mlp.shared_expert.gate_proj": "blk.{i}.ffn_gate_shexp",
    "model.layers.{i}.mlp.shared_expert.up_proj": "blk.{i}.ffn_up_shexp",
    "model.layers.{i}.mlp.shared_expert.down_proj": "blk.{i}.ffn_down_shexp",
    "model.layers.{i}.mlp.shared_expert_gate": "blk.{i}.ffn_gate_inp_shexp",
}
_ARCH_OF = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "llama",  # llama.cpp writes Mixtral as llama with experts
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
}
# Mixtral's per-expert names -> the Qwen ones used above.
_EXPERT_PIECES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _gguf_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    parts = module.split(".")
    key = module
    if len(parts) > 2 and parts[1] == "layers":
        key = ".".join([*parts[:2], "{i}", *parts[3:]])
    if key not in _NAMES:
        raise ValueError(f"no GGUF name for {hf_name!r}")
    return _NAMES[key].replace("{i}", parts[2] if "{i}" in key else "") + "." + suffix


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert matrices (``mlp.experts.J.gate_proj``, Mixtral's ``block_sparse_moe.experts.J.w1``)
    stacked into ``mlp.experts.gate_proj`` ``[E, out, in]`` as llama.cpp stores them; other names unchanged
    (Mixtral's ``block_sparse_moe`` renamed ``mlp``)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, w in tensors.items():
        parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
        if len(parts) == 8 and parts[4] == "experts":
            piece = _EXPERT_PIECES.get(parts[6], parts[6])
            stacked = ".".join([*parts[:5], piece, parts[7]])
            experts.setdefault(stacked, {})[int(parts[5])] = w
        else:
            out[".".join(parts)] = w
    for stacked, by_index in experts.items():
        out[stacked] = np.stack([by_index[j] for j in range(len(by_index))])
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of Q/K rows (interleaved rotary halves), the inverse of transformers'."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    checkpoint: str | Path, out_file: str | Path, quant_type: str = "Q8_0", arch: str | None = None
) -> Path:
    """Write ``checkpoint`` (an HF directory) as a GGUF file.

    Matrices whose row length is a multiple of the block size are stored as ``quant_type`` (F32 keeps
    everything in float32); norms, biases and other matrices stay F32. ``arch`` overrides the written
    ``general.architecture`` (to produce an unsupported file in tests).
    """
    import gguf

    src = Path(checkpoint)
    cfg = json.loads((src / "config.json").read_text())
    model_type = cfg["model_type"]
    gguf_arch = arch or _ARCH_OF[model_type]
    Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out_file), gguf_arch)
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    rope = cfg.get("rope_parameters") or {}
    writer.add_name("mistral" if model_type == "mistral" else f"random-{model_type}")
    # llama.cpp's converter always writes it; OpenVINO GenAI's GGUF reader refuses a file without it
    file_type = "ALL_F32" if quant_type == "F32" else f"MOSTLY_{quant_type}"
    writer.add_file_type(int(gguf.LlamaFileType[file_type]))
    writer.add_context_length(int(cfg["max_position_embeddings"]))
    writer.add_embedding_length(int(cfg["hidden_size"]))
    writer.add_block_count(int(cfg["num_hidden_layers"]))
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(int(cfg["vocab_size"]))
    _add_moe_metadata(writer, cfg)
    _add_tokenizer(writer, src, int(cfg["vocab_size"]))
    qtype = gguf.GGMLQuantizationType[quant_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    tensors = _stack_experts(load_file(str(src / "model.safetensors")))
    if rope.get("rope_type") == "longrope":  # Phi-3: the factors are tensors, the contexts metadata
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    for name in sorted(tensors):
        w = tensors[name].astype(np.float32)
        if gguf_arch == "llama" and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, heads)
        elif gguf_arch == "llama" and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, kv_heads)
        gname = name if name.startswith("rope_factors") else _gguf_name(name)
        if name.endswith("shared_expert_gate.weight"):
            w = w[0]  # llama.cpp stores the shared expert's gate as a vector
        quantize = w.ndim >= 2 and ".ffn_gate_inp" not in gname  # llama.cpp keeps routers in float32
        if quantize and qtype != gguf.GGMLQuantizationType.F32 and w.shape[-1] % block == 0:
            writer.add_tensor(gname, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_file)


def _add_moe_metadata(writer: object, cfg: dict[str, Any]) -> None:
    """Expert counts and sizes as llama.cpp's converter writes them (nothing for a dense model)."""
    import gguf

    assert isinstance(writer, gguf.GGUFWriter)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        return
    writer.add_expert_count(int(experts))
    writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if cfg.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))


def _add_tokenizer(writer: object, src: Path, vocab_size: int) -> None:
    """Byte-level BPE vocabulary, merges, special ids and chat template, as llama.cpp stores them."""
    import gguf

    assert isinstance(writer, gguf.GGUFWriter)
    tok = json.loads((src / "tokenizer.json").read_text())
    config = json.loads((src / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [
        gguf.TokenType.CONTROL
        if t in special
        else gguf.TokenType.NORMAL
        if i in by_id
        else gguf.TokenType.UNUSED
        for i, t in enumerate(tokens)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")  # make_checkpoint's BPE splits text with Qwen2's regex
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(special[config["eos_token"]])
    if config.get("pad_token"):
        writer.add_pad_token_id(special[config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(config["chat_template"])
