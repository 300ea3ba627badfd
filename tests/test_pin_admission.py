"""Pins against admission: another tenant's TTL pins never make a request that fits the pool fail.

The probe (issue 26): pool 6,000 tokens, tenants alpha (kv_quota 0.6) and beta, the hierarchical cache;
the admin pins 1,500 tokens for beta, then alpha's 4,503-token prompt failed with "request exceeds the
KV pool" after two chunks were prefilled. Here the same at a tenth of the size, with chunks of 64 tokens.
Oracles: the finish reason, the worker's own prefill and retraction counters (no chunk computed twice),
the live pins, and the KV invariant at idle (engine_factory checks it).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from radixrt.server.io_struct import GenerateReqInput
from radixrt.worker.tenant_ledger import ACTIVE_WINDOW_S
from tests.engine_fixtures import prompts_of

POOL = 600


def generate(eng, ids: list[int], tenant: str, params: dict[str, Any], pin: bool = False) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """One request as the server sends it for ``tenant`` (``pin``: as POST /pin_prefix does)."""
    control = {"type": "ephemeral", "ttl": 600} if pin else None
    obj = GenerateReqInput(input_ids=ids, sampling_params=params, cache_control=control)

    async def collect() -> Any:
        out = None
        async for item in eng.tokenizer_manager.generate(obj, tenant=tenant):
            out = item
        return out

    return asyncio.run_coroutine_threadsafe(collect(), eng._loop).result()


def pinned_engine(engine_factory, tiny_llama: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Pool 600 with beta's 150-token pin (its whole pin budget: 0.5 x its 0.5 quota of the pool), and a
    clock past beta's activity window so alpha is alone on the server (it may use the whole pool)."""
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "alpha", "api_keys": ["a"], "kv_quota": 0.6},
                                            {"name": "beta", "api_keys": ["b"]}]}))  # fmt: skip
    eng = engine_factory(
        tiny_llama,
        max_total_tokens=POOL,
        tenants=str(path),
        enable_hierarchical_cache=True,
        chunked_prefill_size=64,
    )
    now = [1000.0]
    eng.worker.call(lambda s: setattr(s.ledger, "clock", lambda: now[0]), timeout=30)
    (beta_prompt,) = prompts_of([200], seed=11)
    out = generate(eng, beta_prompt, "beta", {"max_new_tokens": 0}, pin=True)
    assert out["meta_info"]["pinned_tokens"] == 150, out["meta_info"]
    now[0] += ACTIVE_WINDOW_S + 1
    return eng


def counters(eng) -> tuple[int, int, int]:  # type: ignore[no-untyped-def]
    """(prefill tokens computed, retractions, pinned tokens) in the worker now."""
    return eng.worker.call(
        lambda s: (s.stats.computed_prefill_tokens, s.stats.retractions, s.tree.pins.pinned_size()),
        timeout=30,
    )


def test_a_prompt_that_fits_the_pool_is_not_failed_by_another_tenants_pins(
    tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    """451 tokens + beta's 150 pinned > 600: beta's pin yields before alpha's first chunk, so the request
    finishes, each of its tokens computed once (before: 400 "out of KV memory" after 384 wasted tokens)."""
    eng = pinned_engine(engine_factory, tiny_llama, tmp_path)
    computed, retractions, pinned = counters(eng)
    assert pinned == 150
    (prompt,) = prompts_of([451], seed=12)
    out = generate(eng, prompt, "alpha", {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]["finish_reason"]
    after = counters(eng)
    assert after[0] - computed == 451 and after[1] == retractions  # no chunk computed twice
    assert after[2] == 0  # the pin gave way
    assert eng.worker.call(lambda s: s.snapshot()["kv_pins_yielded"], timeout=30) == 1


def test_a_pin_yields_to_a_lone_request_growing_past_it_in_decode(
    tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    """400 prompt tokens fit beside the pin, 400 + 120 generated do not: the lone decoding request gets the
    pinned slots instead of "sequence exceeds the KV pool"."""
    eng = pinned_engine(engine_factory, tiny_llama, tmp_path)
    (prompt,) = prompts_of([400], seed=13)
    out = generate(eng, prompt, "alpha", {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]["finish_reason"]
    assert out["meta_info"]["completion_tokens"] == 120
    assert counters(eng)[2] == 0


def test_a_pin_that_fits_beside_the_request_is_kept(tiny_llama: Path, tmp_path: Path, engine_factory) -> None:
    """Pins yield only what the request cannot run without: 440 + the 150 pinned fit the pool."""
    eng = pinned_engine(engine_factory, tiny_llama, tmp_path)
    (prompt,) = prompts_of([440], seed=14)
    out = generate(eng, prompt, "alpha", {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert counters(eng)[2] == 150
    assert eng.worker.call(lambda s: s.snapshot()["kv_pins_yielded"], timeout=30) == 0


def test_a_prompt_larger_than_the_pool_is_refused_before_any_prefill(
    tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    """It cannot run with every pin gone: refused on arrival, the message names the pool's size."""
    eng = pinned_engine(engine_factory, tiny_llama, tmp_path)
    computed = counters(eng)[0]
    (prompt,) = prompts_of([POOL], seed=15)
    with pytest.raises(
        ValueError,
        match=rf"prompt \({POOL} tokens\) \+ 1 generated does not fit the KV pool \({POOL} tokens\)",
    ):
        generate(eng, prompt, "alpha", {"temperature": 0, "max_new_tokens": 1})  # HTTP: a 400
    assert counters(eng)[0] == computed and counters(eng)[2] == 150
    eng.flush_cache()
