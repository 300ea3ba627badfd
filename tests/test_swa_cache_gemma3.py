"""The sliding-window-aware cache (``--enable-swa-cache``) on Gemma 3 against transformers' Gemma3ForCausalLM.

Oracle: HF greedy fp32 ids on the same random weights (8-token window, every third layer global), batched,
chunked, page sizes 1 and 16, prompts far past the window, and multi-turn conversations whose later turns hit
the cache after the earlier turns' out-of-window local K/V was freed, and after the tree evicted the local
K/V of cached conversations (tombstones) so that part of a prefix is computed again. Every step checks both
pools' accounting (`KVManager.check_invariant`, the engine fixture) and the tree's integrity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixrt import Engine
from radixrt.config.server_args import ServerArgs
from radixrt.kernels.layer_windows import SlotMappedBackend
from radixrt.mem_cache.swa_radix_cache import SWARadixCache
from radixrt.testing.random_checkpoint import make_checkpoint
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

NEW = 12
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
SWA: dict[str, Any] = {"enable_swa_cache": True, "chunked_prefill_size": 32, "max_total_tokens": 2048}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gemma3swa") / "tiny", arch="gemma3", size="tiny", seed=7)


def _expect(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(path, ids, NEW) for ids in prompts]


def _tree(eng: Engine) -> SWARadixCache:
    tree = eng.worker.call(lambda s: s.tree)
    assert isinstance(tree, SWARadixCache)
    return tree


def _swa_stats(eng: Engine) -> dict[str, int]:
    def read(s: Any) -> dict[str, int]:
        tree = s.tree
        return {
            "total": tree.swa.swa_total_slots,
            "held": tree.swa_evictable_size() + tree.swa_protected_size(),
            "cached": tree.total_size(),
            "evicted": tree.swa_evicted_tokens,
            "recomputed": s.kv.swa_recomputed_tokens,
        }

    return eng.worker.call(read)


@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_chunked_equals_transformers(gemma3: Path, engine_factory, page_size: int) -> None:
    """One batch of prompts below, at and far past the window, chunked by 32; then extends of the longest
    from the cache; the tree caches more tokens than the local pool could hold."""
    eng = engine_factory(gemma3, page_size=page_size, swa_full_tokens_ratio=0.25, **SWA)
    assert eng.worker.call(lambda s: any(isinstance(b, SlotMappedBackend) for b in s.runner.backend.of_layer))
    prompts = prompts_of([3, 9, 40, 150, 300], seed=page_size)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    followups = [prompts[4] + p for p in prompts_of([5, 30], seed=9)]
    outs += eng.generate(input_ids=followups, sampling_params=GREEDY)
    assert sum(o["meta_info"]["cached_tokens"] for o in outs[-2:]) >= 2 * (300 // page_size * page_size)
    assert [o["output_ids"] for o in outs] == _expect(gemma3, prompts + followups)
    st = _swa_stats(eng)
    assert st["cached"] >= 300 + 150 and st["held"] <= st["total"] < st["cached"], st


@pytest.mark.parametrize("page_size", [1, 16])
def test_multi_turn_hits_after_window_freed(gemma3: Path, engine_factory, page_size: int) -> None:
    """Turn 2 extends turn 1's prompt + output: the whole of it comes from the cache although the local K/V
    of all but its last window was freed during turn 1; turn 3 again."""
    eng = engine_factory(gemma3, page_size=page_size, swa_full_tokens_ratio=0.1, **SWA)
    convo = prompts_of([300], seed=11)[0]
    for turn in range(3):
        out = eng.generate(input_ids=[convo], sampling_params=GREEDY)[0]
        assert out["output_ids"] == _expect(gemma3, [convo])[0]
        if turn:
            assert out["meta_info"]["cached_tokens"] >= (len(convo) - 40) // page_size * page_size - page_size
        convo = convo + out["output_ids"] + prompts_of([25], seed=20 + turn)[0]
    st = _swa_stats(eng)
    assert st["recomputed"] == 0 and st["held"] <= st["total"] < st["cached"], st


@pytest.mark.parametrize("page_size", [1, 16])
def test_tombstoned_windows_are_recomputed(gemma3: Path, engine_factory, page_size: int) -> None:
    """A local pool too small for every conversation's window: the tree frees the local K/V of cached
    conversations (tombstones); their next turn matches only a prefix whose window is intact and computes
    the rest again, with the same ids as transformers."""
    eng = engine_factory(gemma3, page_size=page_size, swa_full_tokens_ratio=0.1, **SWA)
    convos = prompts_of([100, 90, 110, 95], seed=31)
    for turn in range(2):
        outs = eng.generate(input_ids=convos, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == _expect(gemma3, convos)
        for c in convos:  # one at a time: each evicts the local K/V of the others' tails
            eng.generate(input_ids=[c + prompts_of([60], seed=len(c))[0]], sampling_params=GREEDY)
        convos = [
            c + o["output_ids"] + prompts_of([20], seed=turn)[0] for c, o in zip(convos, outs, strict=True)
        ]
    st = _swa_stats(eng)
    assert st["evicted"] > 0 and st["recomputed"] > 0, st
    info = eng.get_server_info()  # /server_info reports the same
    assert (info["swa_evicted_tokens"], info["swa_recomputed_tokens"]) == (st["evicted"], st["recomputed"])
    assert info["kv_swa_cached_tokens"] == st["held"] <= info["kv_swa_total_tokens"]
    outs = eng.generate(input_ids=convos, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == _expect(gemma3, convos)


def test_compiled_decode_and_gather_path(gemma3: Path, engine_factory) -> None:
    """Compiled decode reads the local layers through the slot map; so does the gather reference path."""
    prompts = prompts_of([30, 70], seed=6)
    eng = engine_factory(gemma3, disable_compile=False, compile_max_bs=2, **SWA)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    plain = engine_factory(gemma3, **SWA)

    def no_kernels(s: Any) -> None:
        for b in s.runner.backend.by_window.values():
            inner: Any = b.inner if isinstance(b, SlotMappedBackend) else b
            inner.use_decode_kernel = inner.use_extend_kernel = False

    plain.worker.call(no_kernels)
    outs2 = plain.generate(input_ids=prompts, sampling_params=GREEDY)
    expect = _expect(gemma3, prompts)
    assert [o["output_ids"] for o in outs] == expect and [o["output_ids"] for o in outs2] == expect


def test_mixed_chunk_and_salts(gemma3: Path, engine_factory) -> None:
    """Mixed prefill/decode forwards and cache_salt namespaces with the window-aware cache."""
    eng = engine_factory(gemma3, enable_mixed_chunk=True, **SWA)
    prompts = prompts_of([200, 40, 130], seed=41)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    again = eng.generate(input_ids=prompts[:1], sampling_params=GREEDY, cache_salt="other")
    assert again[0]["meta_info"]["cached_tokens"] == 0
    assert [o["output_ids"] for o in outs + again] == _expect(gemma3, prompts + prompts[:1])


def test_refusals(gemma3: Path, tmp_path: Path) -> None:
    """Settings the window-aware cache cannot serve are refused at startup, naming both flags."""
    for extra, words in [
        ({"enable_hierarchical_cache": True}, "enable-hierarchical-cache"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "kv-cache-dtype"),
        ({"speculative_algorithm": "NGRAM"}, "speculative-algorithm"),
        ({"disaggregation_mode": "prefill"}, "disaggregation-mode"),
        ({"swa_full_tokens_ratio": 0.0}, "swa_full_tokens_ratio"),
    ]:
        with pytest.raises(ValueError, match=words):
            ServerArgs(enable_swa_cache=True, **extra)
    llama = make_checkpoint(tmp_path / "llama", arch="llama", size="tiny", seed=1)
    with pytest.raises(ValueError, match="enable_swa_cache: .* does not interleave"):
        Engine(model_path=str(llama), dtype="float32", enable_swa_cache=True, max_total_tokens=2048)
    with pytest.raises(ValueError, match="swa_full_tokens_ratio: the local layers' pool"):
        Engine(model_path=str(gemma3), dtype="float32", enable_swa_cache=True, max_total_tokens=2048,
               swa_full_tokens_ratio=0.01)  # fmt: skip


def test_pinned_conversation_keeps_its_window(gemma3: Path, engine_factory) -> None:
    """A TTL pin locks the local K/V of the pinned prefix's last window: under a local pool too small for
    every conversation, the pinned one's next turn is served whole from the cache; the others recompute."""
    eng = engine_factory(gemma3, swa_full_tokens_ratio=0.1, **SWA)
    pinned = prompts_of([100], seed=51)[0]
    out = eng.generate(
        input_ids=[pinned], sampling_params=GREEDY, cache_control={"type": "ephemeral", "ttl": 600}
    )
    assert out[0]["meta_info"]["pinned_tokens"] == len(pinned) + NEW - 1
    others = prompts_of([90, 110, 95, 120, 100], seed=52)
    for p in others:
        eng.generate(input_ids=[p], sampling_params=GREEDY)
    assert _swa_stats(eng)["evicted"] > 0
    turn2 = pinned + out[0]["output_ids"] + prompts_of([20], seed=53)[0]
    again = eng.generate(input_ids=[turn2], sampling_params=GREEDY)[0]
    assert again["meta_info"]["cached_tokens"] == len(pinned) + NEW - 1
    assert again["output_ids"] == _expect(gemma3, [turn2])[0]


def test_without_radix_cache(gemma3: Path, engine_factory) -> None:
    """With --disable-radix-cache the local K/V of long prompts is still freed out of the window."""
    eng = engine_factory(gemma3, disable_radix_cache=True, swa_full_tokens_ratio=0.1, **SWA)
    prompts = prompts_of([400, 250], seed=61)  # together more than the 204-token local pool
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == _expect(gemma3, prompts)
