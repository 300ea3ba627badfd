"""The random checkpoints and the tokenizer loader that every other test builds on."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from radixrt.models.tokenizer import eos_token_ids, load_tokenizer
from radixrt.testing import random_checkpoint
from radixrt.testing.random_checkpoint import make_checkpoint, qwen_tokenizer_dir

ARCH_FIXTURES = ["tiny_llama", "tiny_mistral", "tiny_qwen2", "tiny_qwen3"]
TEXTS = [
    "Hello world, the server answered 42 questions.",
    "def add(x, y):\n    return x + y\n",
    '{"name": "tree", "value": [1, 2, 3]}',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, ünïcödé, emoji 🙂 and\ttabs",
    "",
]
PROMPTS = ["Once upon a time", "The cache of the prefix tree", '{"answer":', "1 2 3"]


def _hf_model(path: Path) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_checkpoint_loads_in_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    model = _hf_model(path)
    config = model.config
    assert config.model_type == fixture.removeprefix("tiny_")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (256, 4, 8)
    assert config.num_key_value_heads == 2 and config.vocab_size == 8192
    assert config.max_position_embeddings == 2048
    # Everything was redrawn: no all-ones norm or all-zero bias for a buggy loader to get right by luck.
    for name, param in model.named_parameters():
        assert param.std() > 0, name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 8192) and torch.isfinite(logits).all()


def test_arch_specific_features(
    tiny_llama: Path, tiny_mistral: Path, tiny_qwen2: Path, tiny_qwen3: Path
) -> None:
    llama = _hf_model(tiny_llama)
    rope = llama.config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 64
    assert not llama.config.tie_word_embeddings
    # HF really applies the Llama-3 frequency scaling: low frequencies are divided by `factor`.
    head_dim = llama.config.hidden_size // llama.config.num_attention_heads
    base = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv_freq = llama.model.rotary_emb.inv_freq
    assert torch.allclose(inv_freq[:2], base[:2])  # wavelength < 64 / high_freq_factor: unchanged
    assert torch.allclose(inv_freq[-1], base[-1] / rope["factor"])  # wavelength > 64: scaled by 1/8

    assert _hf_model(tiny_mistral).config.sliding_window is None

    qwen2 = _hf_model(tiny_qwen2)
    assert qwen2.config.tie_word_embeddings
    assert qwen2.lm_head.weight.data_ptr() == qwen2.model.embed_tokens.weight.data_ptr()
    attn = qwen2.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.q_proj.bias.abs().sum() > 0

    qwen3 = _hf_model(tiny_qwen3)
    assert qwen3.config.head_dim == 48 != qwen3.config.hidden_size // qwen3.config.num_attention_heads
    assert qwen3.model.layers[0].self_attn.q_proj.weight.shape == (8 * 48, 256)
    assert qwen3.model.layers[0].self_attn.q_norm.weight.shape == (48,)


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_greedy_outputs_are_varied_and_decisive(
    fixture: str, request: pytest.FixtureRequest, tokenizer_for: Callable[[Path], PreTrainedTokenizerFast]
) -> None:
    """The weight scaling's purpose: greedy fp32 decoding must not hinge on near-ties (op-order noise in
    the logits is ~3e-5) and must not collapse into one repeated token."""
    path: Path = request.getfixturevalue(fixture)
    model, tok = _hf_model(path), tokenizer_for(path)
    margins = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        new: list[int] = []
        with torch.no_grad():
            for _ in range(24):  # greedy, recomputing the whole sequence (cheaper than generate() here)
                top2 = model(torch.tensor([ids + new])).logits[0, -1].topk(2)
                margins.append(float(top2.values[0] - top2.values[1]))
                new.append(int(top2.indices[0]))
        assert len(set(new)) >= len(new) // 2, (prompt, new)
    margins_t = torch.tensor(margins)
    assert margins_t.median() > 0.1
    assert (margins_t < 1e-2).float().mean() < 0.05
    assert margins_t.min() > 1e-4


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_load_tokenizer_matches_tokenizers_library(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    tok = load_tokenizer(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids, text
        assert tok.decode(ids) == raw.decode(ids, skip_special_tokens=False) == text
    assert len(tok) == raw.get_vocab_size() == 8192
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    end, im_end = raw.token_to_id("<|endoftext|>"), raw.token_to_id("<|im_end|>")
    assert eos_token_ids(tok, path) == [im_end, end]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_load_tokenizer_real_qwen_files() -> None:
    """The real Qwen2 tokenizer: ids equal the tokenizers library's, special tokens come from the config."""
    path = qwen_tokenizer_dir()
    tok = load_tokenizer(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text) == raw.encode(text).ids, text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert "<|im_start|>" in tok.all_special_tokens
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert str(chat).startswith("<|im_start|>user\nHi<|im_end|>")


def test_load_tokenizer_sources_and_errors(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    # A standalone chat_template.jinja wins over the tokenizer_config.json field.
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((tiny_llama / name).read_bytes())
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = load_tokenizer(model_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "x!"
    # eos ids: an int in config.json and a list in generation_config.json, merged without duplicates.
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert eos_token_ids(tok, model_dir) == [tok.eos_token_id, 7, 5]


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_make_checkpoint_is_deterministic(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", arch="qwen3", seed=7, num_hidden_layers=1)
    b = make_checkpoint(tmp_path / "b", arch="qwen3", seed=7, num_hidden_layers=1)
    c = make_checkpoint(tmp_path / "c", arch="qwen3", seed=8, num_hidden_layers=1)
    files_a = _file_bytes(a)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(files_a)
    assert files_a == _file_bytes(b)
    assert files_a["model.safetensors"] != _file_bytes(c)["model.safetensors"]
    assert json.loads(files_a["config.json"])["num_hidden_layers"] == 1


def test_bpe_training_is_deterministic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The cached tokenizer.json equals a fresh training run, so a cache wipe changes no token ids."""
    cached = random_checkpoint.bpe_tokenizer_json().read_text()
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    fresh = random_checkpoint.bpe_tokenizer_json()
    assert fresh.parent == tmp_path
    assert fresh.read_text() == cached


def test_no_top_level_kernels_package_to_confuse_transformers(tiny_llama: Path) -> None:
    """transformers optionally uses a PyPI package named `kernels` (hub kernels). radixrt's attention kernels
    live in `radixrt.kernels`, so no `kernels` is importable here, transformers sees none, and models load."""
    import importlib.util

    from transformers.utils import import_utils

    assert importlib.util.find_spec("kernels") is None
    model = _hf_model(tiny_llama)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()
    if hasattr(import_utils, "is_kernels_available"):
        assert not import_utils.is_kernels_available()
