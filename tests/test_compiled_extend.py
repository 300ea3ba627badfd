"""Extend forwards through the compiled layers with a symbolic token count (radixrt.worker.extend_graphs)
against HF transformers and the eager path."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixrt.worker import extend_graphs
from tests.engine_fixtures import prompts_of, record_token_counts
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def count_extends(eng) -> list[int]:  # type: ignore[no-untyped-def]
    """Record the new-token count of every forward the compiled extend path runs."""
    er = eng.worker.scheduler.runner.extend_runner
    assert er is not None
    return record_token_counts(er, "forward")


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_compiled_extend_matches_hf(arch: str, request: pytest.FixtureRequest, engine_factory) -> None:
    """fp32 greedy ids equal transformers' for prompts run as compiled extends: one request alone, several in
    one batch, and extends over a cached prefix (a second request repeating the first's prompt)."""
    path = request.getfixturevalue(arch)
    eng = engine_factory(path, disable_compile=False, compile_max_bs=2)
    seen = count_extends(eng)
    first = prompts_of([150], seed=3)[0]
    assert eng.generate(input_ids=first, sampling_params=GREEDY)["output_ids"] == hf_greedy(path, first, 6)
    assert seen == [150]
    # A batch: a fresh prompt, one over the cached 150 tokens, and one too short to compile on its own.
    prompts = [prompts_of([90], seed=4)[0], first + prompts_of([70], seed=5)[0], prompts_of([9], seed=6)[0]]
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(path, ids, GREEDY["max_new_tokens"])
    assert outs[1]["meta_info"]["cached_tokens"] >= 150
    assert len(seen) > 1 and all(n >= extend_graphs.MIN_TOKENS for n in seen)


def test_short_extends_stay_eager(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=2)
    seen = count_extends(eng)
    ids = prompts_of([extend_graphs.MIN_TOKENS - 1], seed=7)[0]
    assert eng.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == hf_greedy(tiny_llama, ids, 6)
    assert seen == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_extend_int4_matches_eager(tmp_path: Path, dtype: str, engine_factory) -> None:
    """int4 linears that switch to their dense weight from 100 rows: extends of 70 and 200 tokens take both
    branches of one symbolic graph (a guard recompiles the second). Equal to eager token for token in fp32; in
    bf16 the fused ops round differently, so the first tokens must agree."""
    from radixrt.testing.random_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "m", arch="llama", seed=15, intermediate_size=704)
    prompts = prompts_of([70, 200], seed=10)
    kw = {"dtype": dtype, "quantization": "int4", "dense_gemm_min_tokens": 100, "chunked_prefill_size": 256}
    eager = engine_factory(path, **kw)
    eng = engine_factory(path, disable_compile=False, compile_max_bs=2, **kw)
    seen = count_extends(eng)
    n = GREEDY["max_new_tokens"] if dtype == "float32" else 2
    for ids in prompts:  # one at a time: each extend is one branch
        want = eager.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
        got = eng.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
        assert got[:n] == want[:n]
    assert seen == [70, 200]


def test_compiled_extend_two_layer_kinds_equals_eager(tmp_path: Path, engine_factory) -> None:
    """Gemma 3 (local and global layers: two compiled kinds, sliding windows in the backend): compiled
    extends give the eager path's greedy ids (fp32)."""
    from radixrt.testing.random_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "gemma3", arch="gemma3", size="tiny", seed=7)
    prompts = prompts_of([120, 75], seed=11, vocab=200)
    eager = engine_factory(path).generate(input_ids=prompts, sampling_params=GREEDY)
    eng = engine_factory(path, disable_compile=False, compile_max_bs=2)
    assert len(set(eng.worker.scheduler.runner.extend_runner._kind_of)) == 2
    seen = count_extends(eng)
    compiled = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert seen
    assert [o["output_ids"] for o in compiled] == [o["output_ids"] for o in eager]


def test_compiled_extend_switch(tiny_llama: Path, engine_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """RADIXRT_COMPILED_EXTEND=0 keeps extends eager; a bad value names the variable."""
    monkeypatch.setenv(extend_graphs.ENV, "0")
    eng = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=2)
    assert eng.worker.scheduler.runner.extend_runner is None
    assert eng.worker.scheduler.runner.graph_runner is not None
    monkeypatch.setenv(extend_graphs.ENV, "on")
    with pytest.raises(ValueError, match=extend_graphs.ENV):
        extend_graphs.compiled_extend_enabled()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_compiled_extend_moe_equals_eager(arch: str, tmp_path: Path, engine_factory) -> None:
    """Mixture-of-experts layers: the routed experts run through their opaque op inside the compiled extend
    graphs; fp32 greedy ids equal the eager path's."""
    from radixrt.testing.random_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / arch, arch=arch, size="tiny", seed=21)
    prompts = prompts_of([100, 70], seed=13, vocab=200)
    eager = engine_factory(path).generate(input_ids=prompts, sampling_params=GREEDY)
    eng = engine_factory(path, disable_compile=False, compile_max_bs=2)
    seen = count_extends(eng)
    compiled = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert seen
    assert [o["output_ids"] for o in compiled] == [o["output_ids"] for o in eager]
