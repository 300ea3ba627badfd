"""The compiled decode step (per batch-size bucket) against HF transformers and the eager path."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixrt.worker.graph_runner import compile_buckets
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def test_buckets() -> None:
    assert compile_buckets(1) == [1]
    assert compile_buckets(8) == [1, 2, 4, 8]
    assert compile_buckets(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="compile_max_bs"):
        compile_buckets(0)


def count_compiled(eng) -> list[int]:  # type: ignore[no-untyped-def]
    """Wrap the graph runner so the test sees the padded batch size of every compiled forward (plain and
    greedy-head forwards both run the compiled layers)."""
    gr = eng.worker.scheduler.runner.graph_runner
    seen: list[int] = []
    inner = gr._layers

    def spy(ids, positions, md):  # type: ignore[no-untyped-def]
        seen.append(int(ids.shape[0]))
        return inner(ids, positions, md)

    gr._layers = spy
    return seen


def test_greedy_head_and_sampled_path_agree(tiny_llama: Path, engine_factory) -> None:
    """Plain greedy batches take the argmax inside the compiled graph; asking for logprobs forces the
    logits path. Both give HF's greedy ids, and the logprob of each chosen token is the row's maximum."""
    eng = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=2)
    gr = eng.worker.scheduler.runner.graph_runner
    calls = {"greedy": 0}
    inner = gr.forward_greedy

    def spy(ids, positions, md):  # type: ignore[no-untyped-def]
        calls["greedy"] += 1
        return inner(ids, positions, md)

    gr.forward_greedy = spy
    prompts = prompts_of([6, 19], seed=4)
    plain = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert calls["greedy"] >= GREEDY["max_new_tokens"] - 1
    calls["greedy"] = 0
    scored = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2)
    assert calls["greedy"] == 0
    for ids, a, b in zip(prompts, plain, scored, strict=True):
        assert a["output_ids"] == b["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
        for (lp, _tok, _), top in zip(
            b["meta_info"]["output_token_logprobs"], b["meta_info"]["output_top_logprobs"], strict=True
        ):
            assert lp == pytest.approx(top[0][0], abs=1e-6)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_compiled_decode_matches_hf(arch: str, request: pytest.FixtureRequest, engine_factory) -> None:
    path = request.getfixturevalue(arch)
    eng = engine_factory(path, disable_compile=False, compile_max_bs=4)
    seen = count_compiled(eng)
    prompts = prompts_of([5, 33, 17], seed=8)  # 3 requests: padded to bucket 4
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(path, ids, GREEDY["max_new_tokens"])
    assert seen and set(seen) == {4}


@pytest.mark.parametrize("page_size", [1, 16])
def test_compiled_and_eager_batches_mix(tiny_llama: Path, page_size: int, engine_factory) -> None:
    """Batch sizes above the largest bucket run eagerly; a shrinking batch moves between buckets."""
    eng = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=2, page_size=page_size,
                         chunked_prefill_size=16)  # fmt: skip
    seen = count_compiled(eng)
    prompts = prompts_of([4, 40, 9, 21, 3], seed=9)
    params = [{**GREEDY, "max_new_tokens": n} for n in (3, 12, 6, 9, 1)]
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    for ids, p, out in zip(prompts, params, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, p["max_new_tokens"])
    assert {1, 2} <= set(seen)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_int4_matches_eager(tmp_path: Path, dtype: str, engine_factory) -> None:
    """The fast configuration (int4, compiled) against its own eager twin: exact in fp32; in bf16 the
    fused ops round differently, so only the first decode tokens must agree."""
    from radixrt.testing.random_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "m", arch="llama", seed=15, intermediate_size=704)
    prompts = prompts_of([6, 19], seed=10)
    kw = {"dtype": dtype, "quantization": "int4"}
    eager = engine_factory(path, **kw).generate(input_ids=prompts, sampling_params=GREEDY)
    eng = engine_factory(path, disable_compile=False, compile_max_bs=2, **kw)
    seen = count_compiled(eng)
    compiled = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert seen
    n = GREEDY["max_new_tokens"] if dtype == "float32" else 3
    for e, c in zip(eager, compiled, strict=True):
        assert e["output_ids"][:n] == c["output_ids"][:n]
