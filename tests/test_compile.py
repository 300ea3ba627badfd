"""The compiled decode step (per batch-size bucket) against HF transformers and the eager path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt.worker.graph_runner import compile_buckets
from tests.engine_fixtures import prompts_of, record_token_counts
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
    return record_token_counts(eng.worker.scheduler.runner.graph_runner, "_layers")


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


@pytest.mark.parametrize(
    ("arch", "scope"),
    [("tiny_llama", "layer"), ("tiny_qwen2", "layer"), ("tiny_qwen3", "layer"), ("tiny_llama", "model"),
     ("tiny_qwen3", "model")],
)  # fmt: skip
def test_compiled_decode_matches_hf(
    arch: str, scope: str, request: pytest.FixtureRequest, engine_factory
) -> None:
    """Greedy fp32 ids equal transformers' with each --compile-scope: per-layer graphs and the whole stack."""
    path = request.getfixturevalue(arch)
    eng = engine_factory(path, disable_compile=False, compile_max_bs=4, compile_scope=scope)
    assert eng.worker.scheduler.runner.graph_runner.scope == scope
    assert eng.worker.scheduler.runner.graph_runner.native is not None  # radixrt.kernels.decode_op
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


def test_layer_kinds_split_what_a_graph_depends_on(tiny_llama: Path, tmp_path: Path, engine_factory) -> None:
    """Layers share an unguarded compiled function only when alike: a Llama's layers are one kind (their
    layer_id differs), Gemma 3's local and global layers are two, and a layer whose linear is another class or
    dtype is a kind of its own."""
    from radixrt.layers.quant_linear import Int4Linear
    from radixrt.testing.random_checkpoint import make_checkpoint
    from radixrt.worker.graph_runner import layer_kind

    def kinds(eng) -> list:  # type: ignore[no-untyped-def]
        layers = eng.worker.scheduler.runner.model.layers
        return [layer_kind(layer) for layer in layers]

    llama = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=1)
    ks = kinds(llama)
    assert len(ks) > 1 and len(set(ks)) == 1
    assert llama.worker.scheduler.runner.graph_runner._kind_of == [0] * len(ks)
    layer = llama.worker.scheduler.runner.model.layers[0]
    before = layer_kind(layer)
    up = layer.mlp.up_proj
    layer.mlp.up_proj = Int4Linear.from_float(up.weight.detach().float())
    assert layer_kind(layer) != before
    layer.mlp.up_proj = up.to(torch.float64)
    assert layer_kind(layer) != before
    layer.mlp.up_proj = up.float()
    assert layer_kind(layer) == before

    gemma3 = make_checkpoint(tmp_path / "gemma3", arch="gemma3", size="tiny", seed=7)
    gemma = engine_factory(gemma3, disable_compile=False, compile_max_bs=1)
    local = [layer.is_local for layer in gemma.worker.scheduler.runner.model.layers]
    ks = kinds(gemma)
    assert True in local and False in local
    assert len(set(ks)) == 2
    assert all((ks[i] == ks[j]) == (local[i] == local[j]) for i in range(len(ks)) for j in range(len(ks)))


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_compiled_decode_with_mixed_layers_equals_eager(tmp_path: Path, scope: str, engine_factory) -> None:
    """A model whose layers differ (one layer's MLP int4, the rest dense fp32) compiles one function per
    kind and bucket (or traces the whole stack): its compiled greedy decode equals its eager decode token for
    token (fp32)."""
    from radixrt.layers.quant_linear import Int4Linear
    from radixrt.testing.random_checkpoint import make_checkpoint
    from radixrt.worker.graph_runner import DecodeGraphRunner

    path = make_checkpoint(tmp_path / "m", arch="llama", seed=16, intermediate_size=704)
    prompts = prompts_of([7, 15, 4], seed=12)
    eng = engine_factory(path, disable_compile=False, compile_max_bs=4)

    def mix(s) -> int:  # type: ignore[no-untyped-def]
        runner = s.runner
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(runner.model.layers[1].mlp, name)
            setattr(runner.model.layers[1].mlp, name, Int4Linear.from_float(lin.weight.detach().float()))
        runner.graph_runner = DecodeGraphRunner(runner.model, runner.backend, 4, scope)
        runner.graph_runner.warmup(runner._run_padding_batch)
        return len(set(runner.graph_runner._kind_of))

    assert eng.worker.call(mix, timeout=300) == 2  # kinds (the model scope traces them all in one graph)
    seen = count_compiled(eng)
    compiled = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert {4} <= set(seen)

    def eager(s) -> None:  # type: ignore[no-untyped-def]
        s.runner.graph_runner = None

    eng.worker.call(eager, timeout=60)
    assert eng.flush_cache()
    again = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in compiled] == [o["output_ids"] for o in again]


def test_compile_scope_is_checked() -> None:
    from radixrt.worker.graph_runner import DecodeGraphRunner

    with pytest.raises(ValueError, match="compile_scope"):
        DecodeGraphRunner(None, None, 4, "stack")  # type: ignore[arg-type]


def test_python_attention_op_when_the_native_one_is_off(
    tiny_llama: Path, engine_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RADIXRT_NATIVE_DECODE_OP=0 keeps the Python op in the graphs: same ids; a bad value names the variable."""
    from radixrt.kernels import decode_op

    monkeypatch.setenv(decode_op.NATIVE_ENV, "0")
    eng = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=4)
    assert eng.worker.scheduler.runner.graph_runner.native is None
    seen = count_compiled(eng)
    prompts = prompts_of([5, 33, 17], seed=8)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
    assert seen
    monkeypatch.setenv(decode_op.NATIVE_ENV, "yes")
    with pytest.raises(ValueError, match=decode_op.NATIVE_ENV):
        decode_op.unavailable_reason()


def test_python_wrapper_when_the_cpp_wrapper_is_off(
    tiny_llama: Path, engine_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RADIXRT_COMPILE_CPP_WRAPPER=0 compiles the decode graphs with inductor's Python wrapper: the same greedy
    ids as transformers; the default is the C++ wrapper; a bad value names the variable."""
    from radixrt.worker import graph_runner

    assert graph_runner.cpp_wrapper_enabled()
    monkeypatch.setenv(graph_runner.CPP_WRAPPER_ENV, "0")
    assert not graph_runner.cpp_wrapper_enabled()
    eng = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=2)
    seen = count_compiled(eng)
    prompts = prompts_of([5, 33], seed=9)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
    assert seen
    monkeypatch.setenv(graph_runner.CPP_WRAPPER_ENV, "cpp")
    with pytest.raises(ValueError, match=graph_runner.CPP_WRAPPER_ENV):
        graph_runner.cpp_wrapper_enabled()


def test_two_engines_decode_concurrently(tiny_llama: Path, tiny_qwen2: Path, engine_factory) -> None:
    """Two engines in one process, each stepping its compiled decode on its own scheduler thread at the same
    time: the attention op's per-step state is per thread, so each gets its own model's greedy ids."""
    import threading

    engines = {
        p: engine_factory(p, disable_compile=False, compile_max_bs=4) for p in (tiny_llama, tiny_qwen2)
    }
    prompts = prompts_of([5, 33, 17], seed=21)
    params = {**GREEDY, "max_new_tokens": 24}
    results: dict[Path, list[list[list[int]]]] = {p: [] for p in engines}
    errors: list[BaseException] = []

    def run(path: Path) -> None:
        try:
            for _ in range(3):
                outs = engines[path].generate(input_ids=prompts, sampling_params=params)
                results[path].append([o["output_ids"] for o in outs])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for path, runs in results.items():
        expected = [hf_greedy(path, ids, 24) for ids in prompts]
        assert runs == [expected] * 3, path.name
