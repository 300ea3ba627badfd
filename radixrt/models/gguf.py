"""GGUF checkpoints: read a llama.cpp file's config, tokenizer and tensors; convert it once to HF format.

The libraries do the work: `gguf` reads the file and dequantizes blocks, transformers maps the metadata to
an HF config and tokenizer and supplies the Q/K row permutation llama.cpp applies to Llama attention
weights (`LlamaTensorProcessor`). radixrt only names tensors the HF way (through gguf's own name map) and
keeps each tensor's blocks untouched (`GGUFWeight`), so quantized layers can use them directly; the
baseline path dequantizes them once into a cached HF directory (`converted_dir`).

Mixture-of-experts files store each projection of all experts as one ``[E, out, in]`` tensor
(``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``); they are named ``mlp.experts.gate_proj`` etc. here
and written as transformers 5's stacked ``mlp.experts.gate_up_proj`` / ``down_proj``. Mixtral is a llama file
with ``llama.expert_count``; the expert sizes transformers' config mapping drops
(``expert_feed_forward_length``, ``expert_shared_feed_forward_length``) are read here, as are Phi-3's
LongRoPE factors (tensors ``rope_factors_long`` / ``rope_factors_short``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixrt.config.cache_dir import build_dir_once, cache_dir

# GGUF `general.architecture` -> what transformers calls it (`model_type`) may differ (a Llama-architecture
# file named "mistral" becomes Mistral); the HF class radixrt builds per model_type:
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen2moe", "qwen3moe")
HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# Tensor types `gguf.quants` dequantizes that radixrt accepts (the common llama.cpp file types).
GGML_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# Bump when the converted directory's contents change: it keys the cache.
CONVERT_VERSION = "gguf-convert-v2"
SOURCE_FILE = "radixrt_gguf.json"
# HF module names of one decoder layer, as gguf's tensor name map knows them.
_LAYER_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",  # Gemma 3
    "post_feedforward_layernorm",
    "mlp.gate",  # mixture of experts: the router, the stacked experts, Qwen2-MoE's shared expert
    "mlp.experts.gate_proj",
    "mlp.experts.up_proj",
    "mlp.experts.down_proj",
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
)
# Phi-3's fused projections: ``ffn_up`` holds [gate; up] there (a llama file's ``ffn_up`` is up_proj).
_PHI3_MODULES = tuple(m for m in _LAYER_MODULES if m not in ("mlp.gate_proj", "mlp.up_proj")) + (
    "self_attn.qkv_proj",
    "mlp.gate_up_proj",
)
# Tensors some GGUF files carry that the HF model derives itself (Llama 3 rope factors come from metadata;
# Phi-3's LongRoPE factors go into the config, `hf_config`).
_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class GGUFWeight:
    """One tensor of a GGUF file under its HF name, with its bytes as the file stores them.

    ``data`` is a uint8 array ``[rows, row_bytes]`` for block-quantized types (rows already in HF order,
    i.e. llama.cpp's Q/K permutation undone: it only moves whole rows, so blocks stay intact), else a
    float array of ``shape``. ``shape`` is the torch shape (``(out, in)`` for a matrix).
    """

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def quantized(self) -> bool:
        return self.ggml_type not in ("F32", "F16", "BF16")

    def dequantize(self) -> torch.Tensor:
        """The float32 tensor (``gguf.quants.dequantize``), shaped like the HF weight."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.data, GGMLQuantizationType[self.ggml_type])
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
            self.shape
        )  # a copy: the file is mmapped read-only


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself if it is a ``.gguf`` file, or the one ``.gguf`` in a directory
    without config.json; None for anything else (an HF directory). Several candidates: ValueError."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix == ".gguf" else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(p.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(f"model_path: {p} holds several GGUF files ({names}); name one of them")
    return found[0] if found else None


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def check_supported(path: Path) -> tuple[str, dict[str, int]]:
    """(architecture, {ggml type name: tensor count}) of a GGUF file; ValueError naming what is unsupported."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = str(_field(reader, "general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF {path.name}: architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    bad = sorted(set(counts) - set(GGML_TYPES))
    if bad:
        raise ValueError(
            f"GGUF {path.name}: tensor type(s) {', '.join(bad)} are not supported; supported: {', '.join(GGML_TYPES)}"
        )
    return arch, counts


def hf_config(path: Path) -> dict[str, Any]:
    """The HF config.json dict of a GGUF file, as transformers maps its metadata (plus ``architectures``)."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    arch, _ = check_supported(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    _add_dropped_fields(GGUFReader(path), arch, config)
    model_type = str(config.get("model_type"))
    if model_type not in HF_CLASSES:
        raise ValueError(
            f"GGUF {path.name}: model type {model_type!r} is not supported; supported: {list(HF_CLASSES)}"
        )
    config["architectures"] = [HF_CLASSES[model_type]]
    config["dtype"] = "float32"
    for key in ("_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    return config


def _add_dropped_fields(reader: Any, arch: str, config: dict[str, Any]) -> None:
    """What transformers' GGUF config mapping leaves out: expert sizes (a llama file with experts is
    Mixtral; every layer of a GGUF MoE is sparse), the top-k renormalization when the file says, and Phi-3's
    LongRoPE factors and sliding window."""
    experts = _field(reader, f"{arch}.expert_count")
    if experts:
        if arch == "llama":
            config.update(model_type="mixtral", num_local_experts=int(experts), sliding_window=None)
        else:
            config.update(num_experts=int(experts), decoder_sparse_step=1, mlp_only_layers=[])
            config["moe_intermediate_size"] = int(_field(reader, f"{arch}.expert_feed_forward_length"))
        config["num_experts_per_tok"] = int(_field(reader, f"{arch}.expert_used_count"))
        if arch == "qwen2moe":
            shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
            config["shared_expert_intermediate_size"] = int(shared or 0)
        norm = _field(reader, f"{arch}.expert_weights_norm")
        if norm is not None:
            config["norm_topk_prob"] = bool(norm)
    if arch != "phi3":
        return
    window = _field(reader, "phi3.attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if not factors:
        return
    original = int(_field(reader, "phi3.rope.scaling.original_context_length"))
    rope = dict(config.get("rope_parameters") or {})
    rope.update(rope_type="longrope", original_max_position_embeddings=original)
    for kind in ("long", "short"):
        rope[f"{kind}_factor"] = [float(v) for v in factors[f"rope_factors_{kind}.weight"].data]
    attn_factor = _field(reader, "phi3.rope.scaling.attn_factor")
    if attn_factor is not None:
        rope["attention_factor"] = float(attn_factor)
    config.update(rope_parameters=rope, original_max_position_embeddings=original)


def read_weights(path: Path, config: dict[str, Any]) -> dict[str, GGUFWeight]:
    """Every tensor of the file under its HF name (``model.layers.0.self_attn.q_proj.weight``, ...).

    Raises ValueError for a tensor that does not belong to the architecture.
    """
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = GGUFReader(path)
    arch_name = str(_field(reader, "general.architecture"))
    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name)
    layers = int(config["num_hidden_layers"])
    name_map = get_tensor_name_map(arch, layers)
    modules = _PHI3_MODULES if arch_name == "phi3" else _LAYER_MODULES
    hf_modules = ["model.embed_tokens", "model.norm", "lm_head"] + [
        f"model.layers.{i}.{m}" for i in range(layers) for m in modules
    ]
    to_hf = {g: hf for hf in hf_modules if (g := name_map.get_name(hf)) is not None}
    # NOTE: llama.cpp permutes Q/K rows of Llama-architecture files only; qwen2/qwen3 files are stored as is.
    permute = LlamaTensorProcessor(config=config) if arch_name == "llama" else None
    weights: dict[str, GGUFWeight] = {}
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        base, _, suffix = t.name.rpartition(".")
        if base not in to_hf:
            raise ValueError(f"GGUF {path.name}: tensor {t.name!r} does not belong to a {arch_name} model")
        data: np.ndarray = t.data
        if permute is not None:
            data = permute.process(data, t.name).weights
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists dims fastest-first
        name = f"{to_hf[base]}.{suffix}"
        if arch_name == "gemma3" and name.endswith("norm.weight"):
            # NOTE: llama.cpp stores Gemma's norm weights as 1 + w (its norm multiplies by the weight);
            # transformers' Gemma2TensorProcessor subtracts the 1 again, as here.
            data = np.asarray(data, dtype=np.float32) - 1
        if name.endswith("shared_expert_gate.weight"):
            shape = (1, *shape)  # llama.cpp stores this [1, H] matrix as a vector
        weights[name] = GGUFWeight(name, t.tensor_type.name, shape, data)
    return weights


def _stack_gate_up(tensors: dict[str, torch.Tensor]) -> None:
    """Stacked experts under transformers 5's names: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
    first) and ``mlp.experts.down_proj`` ``[E, H, I]``, in place."""
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_proj.weight")]:
        base = name.removesuffix("gate_proj.weight")
        up = tensors.pop(base + "up_proj.weight")
        tensors[base + "gate_up_proj"] = torch.cat([tensors.pop(name), up], dim=1)
        tensors[base + "down_proj"] = tensors.pop(base + "down_proj.weight")


def _source_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERT_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def convert(path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write an HF checkpoint directory for a GGUF file: config.json, generation_config.json, tokenizer
    files, model.safetensors (blocks dequantized to float32; F16/BF16 tensors kept as they are) and
    ``radixrt_gguf.json`` naming the source file and each tensor's GGUF type."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if progress:  # NOTE: the metadata and the tokenizer take seconds each, outside the tensor bar
        print(
            f"converting {path.name} (first use): reading its metadata and blocks",
            file=sys.stderr,
            flush=True,
        )
    config = hf_config(path)
    weights = read_weights(path, config)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in tqdm(weights.items(), desc=f"converting {path.name}", unit="tensor", disable=not progress):
        t = w.dequantize()
        if w.ggml_type in _FLOAT_DTYPES:  # exact in its own dtype: no need for float32's bytes
            t = t.to(_FLOAT_DTYPES[w.ggml_type])
        tensors[name] = t
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    _stack_gate_up(tensors)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos = config.get("eos_token_id")
    generation = {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": config.get("pad_token_id"),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if progress:
        print(f"converting {path.name}: extracting its tokenizer", file=sys.stderr, flush=True)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out_dir))
    source = {
        "source": str(path.resolve()),
        "size": path.stat().st_size,
        "version": CONVERT_VERSION,
        "ggml_types": {name: w.ggml_type for name, w in weights.items()},
    }
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def converted_dir(path: str | Path, progress: bool = True) -> Path:
    """The cached HF directory of a GGUF file, converting it on first use (safe under concurrency)."""
    src = Path(path)
    final = cache_dir() / "gguf" / f"{src.stem}-{_source_key(src)}"
    return build_dir_once(final, SOURCE_FILE, lambda tmp: convert(src, tmp, progress))


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted directory came from (None for a plain HF directory)."""
    record = Path(model_dir) / SOURCE_FILE
    if not record.is_file():
        return None
    return Path(json.loads(record.read_text())["source"])
