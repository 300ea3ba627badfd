"""RadixCache end to end: identical greedy outputs with the cache on and off, cached_tokens, salts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def shared_prompts(system_len: int, n: int, q_len: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(10, 8000) for _ in range(system_len)]
    return system, [system + [rng.randrange(10, 8000) for _ in range(q_len)] for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_system_prompt_hits_and_matches(tiny_llama: Path, page_size: int, engine_factory) -> None:
    on = engine_factory(tiny_llama, page_size=page_size, chunked_prefill_size=24)
    off = engine_factory(tiny_llama, page_size=page_size, chunked_prefill_size=24, disable_radix_cache=True)
    system, prompts = shared_prompts(70, 4, 9, seed=10)
    first = on.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    rest = on.generate(input_ids=prompts[1:], sampling_params=GREEDY)
    expected_hit = len(system) // page_size * page_size
    for out in rest:
        assert out["meta_info"]["cached_tokens"] == expected_hit
    ref = off.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in [first, *rest]] == [o["output_ids"] for o in ref]
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in ref)
    assert ref[0]["output_ids"] == hf_greedy(tiny_llama, prompts[0], GREEDY["max_new_tokens"])


def test_in_batch_dedup_computes_shared_prefix_once(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama)
    system, prompts = shared_prompts(200, 6, 5, seed=11)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    info = eng.get_server_info()
    union = len(system) + 6 * 5
    assert info["computed_prefill_tokens"] <= union + 6  # at most one extra token per request
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) >= 5 * len(system)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])


def test_in_batch_dedup_short_shared_prefix(tiny_llama: Path, engine_factory) -> None:
    """A few fresh shared tokens (fork siblings' "Step 2 (") are computed once too, as a perfect cache
    would."""
    eng = engine_factory(tiny_llama)
    system, prompts = shared_prompts(4, 6, 5, seed=21)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert eng.get_server_info()["computed_prefill_tokens"] == len(system) + 6 * 5
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])


def test_multi_turn_continuation_hits_previous_turn(tiny_qwen2: Path, engine_factory) -> None:
    eng = engine_factory(tiny_qwen2)
    ids = prompts_of([40], seed=12)[0]
    history = list(ids)
    for _turn in range(3):
        out = eng.generate(input_ids=history, sampling_params=GREEDY)
        assert out["output_ids"] == hf_greedy(tiny_qwen2, history, GREEDY["max_new_tokens"])
        prev_len = len(history)
        history = history + out["output_ids"] + prompts_of([6], seed=prev_len)[0]
        nxt = eng.generate(input_ids=history, sampling_params={**GREEDY, "max_new_tokens": 0})
        # everything but the last generated token (which had no KV yet) was cached
        assert nxt["meta_info"]["cached_tokens"] >= prev_len + len(out["output_ids"]) - 1


def test_n_samples_share_prompt_kv(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama)
    ids = prompts_of([150], seed=13)[0]
    outs = eng.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 6, "n": 4, "seed": 3, "ignore_eos": True}
    )
    assert len(outs) == 4
    assert eng.get_server_info()["computed_prefill_tokens"] <= 150 + 4


def test_eviction_and_retraction_keep_outputs(tiny_llama: Path, engine_factory) -> None:
    small = engine_factory(tiny_llama, max_total_tokens=256, chunked_prefill_size=32)
    system, prompts = shared_prompts(40, 8, 12, seed=14)
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    outs = small.generate(input_ids=prompts, sampling_params=params)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, 30)
    others = prompts_of([100, 90, 110], seed=15)
    small.generate(input_ids=others, sampling_params=params)
    info = small.get_server_info()
    assert info["evicted_tokens"] > 0 and info["retractions"] > 0


def test_cache_salt_isolates_tenants(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama)
    ids = prompts_of([64], seed=16)[0]
    eng.generate(input_ids=ids, sampling_params=GREEDY, cache_salt="alice")
    bob = eng.generate(input_ids=ids, sampling_params=GREEDY, cache_salt="bob")
    anon = eng.generate(input_ids=ids, sampling_params=GREEDY)
    alice = eng.generate(input_ids=ids, sampling_params=GREEDY, cache_salt="alice")
    assert bob["meta_info"]["cached_tokens"] == 0
    assert anon["meta_info"]["cached_tokens"] == 0
    assert alice["meta_info"]["cached_tokens"] == 63
    assert alice["output_ids"] == bob["output_ids"] == anon["output_ids"]


def test_flush_cache(tiny_llama: Path, engine_factory) -> None:
    eng = engine_factory(tiny_llama)
    ids = prompts_of([50], seed=17)[0]
    eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert eng.generate(input_ids=ids, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 49
    assert eng.flush_cache()
    assert eng.generate(input_ids=ids, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_policies_same_outputs(tiny_llama: Path, policy: str, engine_factory) -> None:
    eng = engine_factory(tiny_llama, schedule_policy=policy, max_running_requests=3)
    _, a = shared_prompts(30, 3, 4, seed=18)
    _, b = shared_prompts(50, 3, 4, seed=19)
    prompts = [x for pair in zip(a, b, strict=True) for x in pair]
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])


def test_a_chunked_prompt_streams_no_empty_events(tiny_llama: Path, engine_factory) -> None:
    """A prompt prefilled in several chunks: the stream's first event carries the first token (no event
    per prefill chunk), one event per token, as an unchunked prompt."""
    eng = engine_factory(tiny_llama, chunked_prefill_size=64)
    ids = prompts_of([200], seed=22)[0]
    events = list(eng.generate(input_ids=ids, sampling_params=GREEDY, stream=True))
    assert [len(e["output_ids"]) for e in events] == list(range(1, GREEDY["max_new_tokens"] + 1))
    assert events[-1]["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_batch_attends_the_shared_prefix_once(
    tiny_llama: Path, page_size: int, engine_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests decoding over one cached system prompt take the cascade (radixrt.kernels.cpu_cascade): the
    prompt attended once for all of them; greedy ids equal the engine without it and HF's."""
    from radixrt.kernels import cpu_cascade

    calls: list[int] = []
    real = cpu_cascade.cascade_decode_attention

    def spy(q, k_buf, v_buf, plan, scale):  # type: ignore[no-untyped-def]
        calls.append(int(plan.sharing.sum()))
        return real(q, k_buf, v_buf, plan, scale)

    monkeypatch.setattr(cpu_cascade, "cascade_decode_attention", spy)
    monkeypatch.setenv(cpu_cascade.CASCADE_ENV, "1")
    on = engine_factory(tiny_llama, page_size=page_size)
    monkeypatch.setenv(cpu_cascade.CASCADE_ENV, "0")
    off = engine_factory(tiny_llama, page_size=page_size)
    system, prompts = shared_prompts(90, 5, 7, seed=12)
    on.generate(input_ids=system + [11], sampling_params={**GREEDY, "max_new_tokens": 1})
    got = on.generate(input_ids=prompts, sampling_params=GREEDY)
    assert calls and max(calls) == 5, calls
    n_on = len(calls)
    ref = off.generate(input_ids=prompts, sampling_params=GREEDY)
    assert len(calls) == n_on  # the engine without it never called it
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert got[0]["output_ids"] == hf_greedy(tiny_llama, prompts[0], GREEDY["max_new_tokens"])


def test_compiled_decode_takes_the_cascade_natively(
    tiny_llama: Path, engine_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled step's native op (radixrt.kernels.decode_op) runs the planned cascade: same ids as the
    engine without cascades and as HF."""
    from radixrt.kernels import cpu_cascade

    plans: list[int] = []
    real = cpu_cascade.plan_shared_prefix

    def spy(table, lens, min_positions):  # type: ignore[no-untyped-def]
        plan = real(table, lens, min_positions)
        if plan is not None:
            plans.append(int(plan.sharing.sum()))
        return plan

    monkeypatch.setattr(cpu_cascade, "plan_shared_prefix", spy)
    monkeypatch.setenv(cpu_cascade.CASCADE_ENV, "1")
    on = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=8)
    assert on.worker.scheduler.runner.graph_runner.native is not None
    monkeypatch.setenv(cpu_cascade.CASCADE_ENV, "0")
    off = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=8)
    system, prompts = shared_prompts(90, 6, 5, seed=13)
    on.generate(input_ids=system + [11], sampling_params={**GREEDY, "max_new_tokens": 1})
    got = on.generate(input_ids=prompts, sampling_params=GREEDY)
    assert plans and max(plans) == 6, plans  # padded to bucket 8: the two padding rows do not share
    ref = off.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert got[0]["output_ids"] == hf_greedy(tiny_llama, prompts[0], GREEDY["max_new_tokens"])


def test_extend_over_a_cached_prefix_on_the_sdpa_path(
    tiny_llama: Path, engine_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With extends on the SDPA path (the default for long extends on AMX CPUs), a request extending a cached prefix
    takes the split attention (radixrt.kernels.cpu_cascade.extend_over_prefix); greedy ids equal HF's."""
    from radixrt.kernels import cpu_cascade
    from radixrt.kernels.torch_native import EXTEND_KERNEL_ENV

    calls: list[int] = []
    real = cpu_cascade.extend_over_prefix

    def spy(q, k, v, k_buf, v_buf, prefix_slots, scale):  # type: ignore[no-untyped-def]
        n = (
            prefix_slots.stop - prefix_slots.start
            if isinstance(prefix_slots, slice)
            else prefix_slots.numel()
        )
        calls.append(int(n))
        return real(q, k, v, k_buf, v_buf, prefix_slots, scale)

    monkeypatch.setattr(cpu_cascade, "extend_over_prefix", spy)
    monkeypatch.setenv(EXTEND_KERNEL_ENV, "sdpa")
    eng = engine_factory(tiny_llama)
    system, prompts = shared_prompts(60, 2, 40, seed=14)
    eng.generate(input_ids=prompts[0], sampling_params=GREEDY)
    out = eng.generate(input_ids=prompts[1], sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == len(system)
    assert calls and max(calls) == len(system), calls
    assert out["output_ids"] == hf_greedy(tiny_llama, prompts[1], GREEDY["max_new_tokens"])
