"""Speculative verify inside the compiled decode step (issue 23): a TARGET_VERIFY forward of ``1 + d`` tokens
per request (undrafted requests as plain rows) runs through the per-bucket compiled layers.

Oracles: HF transformers' greedy ids (fp32) and the same engine settings with speculation off; every verify
forward is recorded, so the tests also fail if verifies silently ran eagerly instead. The engine fixture
checks the KV accounting invariant after every step and at teardown (rejected drafts' pages freed).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixrt import Engine
from radixrt.kernels.base import ForwardMode
from radixrt.kernels.torch_native import TorchNativeBackend
from radixrt.mem_cache.kv_pool import KVPool
from radixrt.speculative.suffix_worker import SuffixSpeculator
from radixrt.worker.model_runner import ForwardInput, ModelRunner
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy
from tests.test_speculative import GREEDY, assert_drafts_accepted_and_rejected, corrupted_truth, install

COMPILED = {"disable_compile": False, "compile_max_bs": 4}
SPEC = {
    "speculative_algorithm": "NGRAM",
    "speculative_verify_cost": 1.0,  # verify every draft (the measured policy is tested in test_spec_policy)
    "speculative_max_batch_size": 4,
    "speculative_num_draft_tokens": 3,
}


def record_forwards(eng: Engine) -> Callable[[], list[tuple[str, int, bool]]]:
    """Record (mode, new tokens, compiled?) of every forward of the engine's model runner."""
    log: list[tuple[str, int, bool]] = []

    def patch(s: Any) -> None:
        runner = s.runner
        run = runner._run

        def recorded(fi: ForwardInput, greedy: bool) -> Any:
            compiled = runner._bucket(fi.mode, len(fi.input_ids)) is not None
            log.append((fi.mode.value, len(fi.input_ids), compiled))
            return run(fi, greedy)

        runner._run = recorded

    eng.worker.call(patch)
    return lambda: list(log)


def assert_verified_compiled(log: list[tuple[str, int, bool]]) -> None:
    verifies = [(n, c) for mode, n, c in log if mode == ForwardMode.TARGET_VERIFY.value]
    assert verifies, "no verify forward ran"
    assert all(c for _, c in verifies), f"verify forwards ran eagerly: {verifies}"
    assert any(n > 4 for n, _ in verifies), "no verify needed a bucket above --compile-max-bs"


@pytest.mark.parametrize("kernel", ["decode", "sdpa"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_compiled_verify_matches_hf_and_spec_off(
    tiny_llama: Path, page_size: int, kernel: str, engine_factory
) -> None:
    """Batched, chunked prompts; length, stop-token and logprob requests; drafts accepted and rejected; the
    verify's attention through either kernel of the CPU backend (one C decode query per token, or SDPA over
    each request's gathered K/V)."""
    prompts = prompts_of([5, 70, 17, 48], seed=23)
    n = 20
    refs = {tuple(p): hf_greedy(tiny_llama, p, n) for p in prompts}
    stop = refs[tuple(prompts[2])][9]
    params = [
        {**GREEDY, "max_new_tokens": n},
        {**GREEDY, "max_new_tokens": 7},
        {**GREEDY, "max_new_tokens": n, "stop_token_ids": [stop]},
        {**GREEDY, "max_new_tokens": n},
    ]
    kw = {"page_size": page_size, "chunked_prefill_size": 32, **COMPILED}
    off = engine_factory(tiny_llama, **kw).generate(
        input_ids=prompts, sampling_params=params, return_logprob=[False, False, False, True]
    )
    eng = engine_factory(tiny_llama, **kw, **SPEC)
    eng.worker.call(lambda s: s.runner.backend.use_verify_kernel(kernel))
    install(eng, corrupted_truth(refs))
    log = record_forwards(eng)
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=[False, False, False, True])
    want = [refs[tuple(p)] for p in prompts]
    assert outs[0]["output_ids"] == want[0]
    assert outs[1]["output_ids"] == want[1][:7]
    assert outs[2]["output_ids"] == want[2][: want[2].index(stop) + 1]
    assert outs[3]["output_ids"] == want[3]  # logprobs: never drafted, a plain row of the verify steps
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in off]
    assert_verified_compiled(log())
    assert_drafts_accepted_and_rejected(eng)


def test_sampled_rows_in_compiled_verify_equal_spec_off(tiny_llama: Path, engine_factory) -> None:
    """Seeded sampling and penalties (the logits path of the verify, not the compiled argmax): the same
    tokens as plain compiled decoding, the uniforms being per output index."""
    prompts = prompts_of([12, 30, 21], seed=24)
    params = [
        {"temperature": 0.9, "top_k": 20, "seed": 5, "max_new_tokens": 18, "ignore_eos": True},
        {**GREEDY, "max_new_tokens": 18, "frequency_penalty": 0.5},
        {**GREEDY, "max_new_tokens": 18},
    ]
    off = engine_factory(tiny_llama, **COMPILED).generate(input_ids=prompts, sampling_params=params)
    refs = {tuple(p): o["output_ids"] for p, o in zip(prompts, off, strict=True)}
    eng = engine_factory(tiny_llama, **COMPILED, **SPEC)
    install(eng, corrupted_truth(refs))
    log = record_forwards(eng)
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in off]
    assert_verified_compiled(log())
    assert_drafts_accepted_and_rejected(eng)


def test_constrained_rows_and_suffix_drafts_in_compiled_verify(tiny_qwen2: Path, engine_factory) -> None:
    """Grammar rows (jump-forward on) decode plainly inside compiled verify steps; SUFFIX drafts from the
    served history, warm: greedy ids equal HF's, constrained outputs match their regex and spec-off."""
    free = prompts_of([18, 40], seed=42)
    refs = [hf_greedy(tiny_qwen2, p, 24) for p in free]
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    constrained = {"regex": regex, "temperature": 1.0, "max_new_tokens": 30}
    plain = engine_factory(tiny_qwen2, **COMPILED)
    phone = plain.tokenizer.encode("Phone: ")
    prompts = [free[0], phone, free[1], phone]
    params = [
        {**GREEDY, "max_new_tokens": 24},
        {**constrained, "seed": 3},
        {**GREEDY, "max_new_tokens": 24},
        {**constrained, "seed": 4},
    ]
    want = plain.generate(input_ids=prompts, sampling_params=params)
    eng = engine_factory(
        tiny_qwen2, chunked_prefill_size=16, **COMPILED, **{**SPEC, "speculative_algorithm": "SUFFIX"}
    )
    eng.worker.call(lambda s: setattr(s, "_spec", SuffixSpeculator(s.args)))
    log = record_forwards(eng)
    for _ in range(2):  # the second pass drafts from the first's outputs
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert outs[0]["output_ids"] == refs[0] and outs[2]["output_ids"] == refs[1]
        for o, w in zip(outs[1::2], want[1::2], strict=True):
            assert re.fullmatch(regex, o["text"]) and o["output_ids"] == w["output_ids"]
    assert eng.get_server_info()["jump_forward_tokens"] > 0
    assert_verified_compiled(log())


def test_warmup_measures_the_step_cost(tiny_llama: Path, engine_factory) -> None:
    """With speculation the compiled buckets include full verifies (b x (1 + k) tokens) and warm-up times them,
    times a decode and a verify at a long context, and keeps the faster verify kernel."""
    eng = engine_factory(tiny_llama, **COMPILED, **{**SPEC, "speculative_verify_cost": None})

    def read(s: Any) -> tuple[list[int], dict[int, float], float | None, float, str, list[str]]:
        c, b = s.runner.graph_runner.cost, s.runner.backend
        return (
            s.runner.graph_runner.buckets,
            c.base,
            c.alpha,
            c.per_position + c.per_pair,
            b.verify_kernel,
            b.verify_kernels(),
        )

    buckets, base, alpha, verify, kernel, kernels = eng.worker.call(read)
    assert buckets == [1, 2, 4, 8, 16]  # --compile-max-bs 4: 1, 2, 4; verifies of 1, 2, 4 requests: 4, 8, 16
    assert sorted(base) == buckets and all(t > 0 for t in base.values())
    assert alpha is not None and alpha > 0 and verify > 0 and kernel in kernels == ["decode", "sdpa"]


# -- the backend's verify kernels against a float64 reference ----------------------------------------------
def verify_metadata(prefix_lens: list[int], extend_lens: list[int], page_size: int) -> tuple[Any, int]:
    """TARGET_VERIFY metadata as the model runner builds it, each request on fresh pages after page 0."""
    seq = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    rows = torch.zeros(len(seq) + 1, max(seq) + page_size, dtype=torch.int64)
    start = 1
    for b, n in enumerate(seq):
        pages = -(-n // page_size)
        rows[b, : pages * page_size] = torch.arange(start * page_size, (start + pages) * page_size)
        start += pages
    runner = SimpleNamespace(
        args=SimpleNamespace(page_size=page_size), req_to_token_pool=SimpleNamespace(req_to_token=rows)
    )
    fi = ForwardInput(
        ForwardMode.TARGET_VERIFY, list(range(len(seq))), prefix_lens, extend_lens, [], torch.zeros(0)
    )
    return ModelRunner.build_metadata(runner, fi), start * page_size  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("kernel", ["decode", "sdpa"])
def test_verify_kernels_equal_causal_attention(kernel: str, page_size: int, window: int | None) -> None:
    """Plain rows and drafted requests mixed in one verify: every new token attends causally over its request's
    prefix and the new tokens before it (and itself), as float64 attention computed token by token."""
    H, KVH, D = 6, 2, 16
    prefix, extend = [30, 5, 64, 0, 17], [1, 4, 1, 3, 5]
    md, num_slots = verify_metadata(prefix, extend, page_size)
    g = torch.Generator().manual_seed(2)
    pool = KVPool(num_slots, 1, KVH, D, torch.float32)
    pool.set_kv(
        0,
        torch.arange(num_slots),
        torch.randn(num_slots, KVH, D, generator=g),
        torch.randn(num_slots, KVH, D, generator=g),
    )
    T = sum(extend)
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, KVH, KVH))
    backend = TorchNativeBackend(pool, H, KVH, D, 0.25, window)
    backend.use_verify_kernel(kernel)
    backend.init_forward_metadata(md)
    out = backend.forward(q, k, v, 0, md)
    kb, vb = (t.double() for t in pool.get_kv_buffer(0))
    t = 0
    for b, (p, e) in enumerate(zip(prefix, extend, strict=True)):
        for j in range(e):
            n = p + j + 1
            lo = max(0, n - window) if window else 0
            slots = md.slot_table[b, lo:n]
            for h in range(H):
                kv_h = h // (H // KVH)
                w = torch.softmax(0.25 * kb[slots, kv_h] @ q[t, h].double(), 0)
                torch.testing.assert_close(out[t, h].double(), w @ vb[slots, kv_h], rtol=1e-5, atol=1e-5)
            t += 1
