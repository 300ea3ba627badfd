"""Tenants in the worker: the config's validation, cache namespaces no salt can cross, and KV quotas under
a flooding tenant (against plain LRU, which lets the flood evict everyone)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixrt.config.tenants import TenantConfig, namespace
from radixrt.server.io_struct import GenerateReqInput
from tests.engine_fixtures import prompts_of

ONE = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}


def tenants_file(tmp_path: Path, tenants: list[dict[str, Any]]) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return str(path)


def run(eng, ids: list[int], tenant: str | None, salt: str | None = None) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """One request as the server sends it for an authenticated tenant (the tenant is not a body field)."""
    obj = GenerateReqInput(input_ids=ids, sampling_params=ONE, cache_salt=salt)

    async def collect() -> Any:
        out = None
        async for item in eng.tokenizer_manager.generate(obj, tenant=tenant):
            out = item
        return out

    return asyncio.run_coroutine_threadsafe(collect(), eng._loop).result()


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ({"tenants": []}, "non-empty list"),
        ({"tenants": [{"name": "a"}]}, r"tenants\[0\].api_keys"),
        ({"tenants": [{"name": "_x", "api_keys": ["k"]}]}, r"tenants\[0\].name"),
        ({"tenants": [{"name": "a", "api_keys": ["k"], "kv_quota": 0}]}, r"tenants\[0\].kv_quota"),
        ({"tenants": [{"name": "a", "api_keys": ["k"], "kv_quota": True}]}, r"tenants\[0\].kv_quota"),
        ({"tenants": [{"name": "a", "api_keys": ["k"], "reserved": 0.6}]}, r"tenants\[0\].reserved"),
        ({"tenants": [{"name": "a", "api_keys": ["k"], "colour": 1}]}, r"tenants\[0\].colour"),
        ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "a", "api_keys": ["j"]}]}, "twice"),
        ({"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]}, "api key"),
        ({"tenants": [{"name": "a", "api_keys": ["k"], "priority": 1.5}]}, r"tenants\[0\].priority"),
        ({"tenant": []}, "expected an object"),
    ],
)
def test_config_errors_name_the_field(doc: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        TenantConfig.from_dict(doc)


def test_config_loads_and_finds_keys(tmp_path: Path) -> None:
    cfg = TenantConfig.load(tenants_file(tmp_path, [{"name": "a", "api_keys": ["k1", "k2"], "priority": 2}]))
    assert cfg.by_key("k2") is cfg.get("a") and cfg.by_key("nope") is None and cfg.by_key(None) is None
    assert cfg.get("a").kv_quota == 0.5 and cfg.get("a").priority == 2
    with pytest.raises(ValueError, match="not JSON"):
        (tmp_path / "bad.json").write_text("{")
        TenantConfig.load(tmp_path / "bad.json")


@given(st.text(), st.text(), st.one_of(st.none(), st.text()), st.one_of(st.none(), st.text()))
def test_namespaces_of_two_tenants_never_meet(t1: str, t2: str, s1: str | None, s2: str | None) -> None:
    if t1 != t2:
        assert namespace(t1, s1) != namespace(t2, s2)
    assert namespace(t1, s1) != s2 or s2 is None or not s2.startswith('["tenant"')  # raw salts stay raw


def test_no_salt_crosses_tenants(tiny_llama: Path, tmp_path: Path, engine_factory) -> None:
    cfg = tenants_file(tmp_path, [{"name": "alpha", "api_keys": ["a"]}, {"name": "beta", "api_keys": ["b"]}])
    eng = engine_factory(tiny_llama, tenants=cfg)
    (prompt,) = prompts_of([48], seed=1)
    assert run(eng, prompt, "alpha")["meta_info"]["cached_tokens"] == 0
    assert run(eng, prompt, "alpha")["meta_info"]["cached_tokens"] == 47  # within a tenant the cache works
    salts = [None, "", "alpha", "beta", namespace("alpha", None), namespace("alpha", ""), '["tenant", "alpha"]',
             json.dumps(["tenant", "alpha", None]), "\x00", "a" * 1000]  # fmt: skip
    for salt in salts:
        assert run(eng, prompt, "beta", salt)["meta_info"]["cached_tokens"] == 0, salt
        eng.flush_cache()  # beta's own copy must not hide a cross-tenant hit on the next salt
        run(eng, prompt, "alpha")
    # The in-process Engine (no tenant) does not see the tenants' caches either.
    assert run(eng, prompt, None)["meta_info"]["cached_tokens"] == 0
    # A salt subdivides the tenant's own namespace.
    assert run(eng, prompt, "alpha", "x")["meta_info"]["cached_tokens"] == 0
    assert run(eng, prompt, "alpha", "x")["meta_info"]["cached_tokens"] == 47
    with pytest.raises(ValueError, match="tenant: 'gamma'"):
        bad = run(eng, prompt, "gamma")
        raise ValueError(bad["meta_info"]["finish_reason"]["message"])


@pytest.mark.parametrize("quotas", [True, False], ids=["quotas", "plain-lru"])
def test_a_flooding_tenant_evicts_its_own_prefixes_first(
    quotas: bool, tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    """Pool 640 tokens; quiet caches a 200-token prompt, noisy then sends 12 fresh 150-token prompts.
    With quotas (0.5 each) the flood evicts noisy's own least recent prefixes and quiet's survives;
    with both as one tenant under plain LRU the flood evicts it."""
    cfg = tenants_file(tmp_path, [{"name": "quiet", "api_keys": ["q"]}, {"name": "noisy", "api_keys": ["n"]}])
    kw: dict[str, Any] = {"tenants": cfg} if quotas else {}
    eng = engine_factory(tiny_llama, max_total_tokens=640, **kw)
    quiet, noisy = ("quiet", "noisy") if quotas else (None, None)
    prompts = prompts_of([200] + [150] * 12, seed=2)
    run(eng, prompts[0], quiet)
    for p in prompts[1:]:
        run(eng, p, noisy)
    again = run(eng, prompts[0], quiet)["meta_info"]["cached_tokens"]
    if quotas:
        assert again == 199
        stats = eng.worker.call(lambda s: s.ledger.snapshot(), timeout=30)
        assert stats["noisy"]["evicted_tokens"] > 0 and stats["quiet"]["evicted_tokens"] == 0
        assert stats["noisy"]["kv_tokens_held"] <= stats["noisy"]["kv_quota_tokens"] + 151
    else:
        assert again == 0


def test_quota_gates_admission_under_contention(tiny_llama: Path, tmp_path: Path, engine_factory) -> None:
    """With both tenants busy, noisy (quota 0.15: one request at a time) waits for memory instead of taking it, and every request
    of both tenants finishes; the invariant holds at idle (engine_factory checks it)."""
    cfg = tenants_file(tmp_path, [{"name": "quiet", "api_keys": ["q"], "kv_quota": 0.75},
                                  {"name": "noisy", "api_keys": ["n"], "kv_quota": 0.15, "priority": -1}])  # fmt: skip
    eng = engine_factory(tiny_llama, max_total_tokens=1024, tenants=cfg)
    prompts = prompts_of([120] * 10, seed=3)

    async def burst() -> list[Any]:
        async def one(ids: list[int], tenant: str) -> Any:
            params = {"temperature": 0, "max_new_tokens": 48 if tenant == "quiet" else 8, "ignore_eos": True}
            out = None
            async for item in eng.tokenizer_manager.generate(GenerateReqInput(input_ids=ids, sampling_params=params),
                                                             tenant=tenant):  # fmt: skip
                out = item
            return out

        return await asyncio.gather(*(one(p, "noisy" if i % 2 else "quiet") for i, p in enumerate(prompts)))

    outs = asyncio.run_coroutine_threadsafe(burst(), eng._loop).result()
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    stats = eng.worker.call(lambda s: s.ledger.snapshot(), timeout=30)
    assert stats["noisy"]["quota_waits"] > 0
    assert stats["noisy"]["requests"] == stats["quiet"]["requests"] == 5


def test_a_flooding_tenant_meets_429_within_its_queue_share(
    tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    """Queue bound 4, one running request: noisy (kv_quota 0.25) may have 1 request waiting, quiet (0.75) 3.
    Noisy's burst is refused with 429 beyond its share while quiet's requests, sent after it, all get in."""
    from radixrt.server.tokenizer_manager import RequestFailedError

    cfg = tenants_file(tmp_path, [{"name": "quiet", "api_keys": ["q"], "kv_quota": 0.75},
                                  {"name": "noisy", "api_keys": ["n"], "kv_quota": 0.25}])  # fmt: skip
    eng = engine_factory(
        tiny_llama, max_total_tokens=2048, tenants=cfg, max_queued_requests=4, max_running_requests=1
    )
    prompts = prompts_of([40] * 8, seed=4)
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}

    async def burst() -> list[Any]:
        async def one(ids: list[int], tenant: str) -> Any:
            try:
                async for _ in eng.tokenizer_manager.generate(GenerateReqInput(input_ids=ids, sampling_params=params),
                                                              tenant=tenant):  # fmt: skip
                    pass
            except RequestFailedError as exc:
                return exc
            return "ok"

        tasks = [asyncio.create_task(one(p, "noisy")) for p in prompts[:6]]
        await asyncio.sleep(0.2)  # noisy's burst is in the worker before quiet's requests
        tasks += [asyncio.create_task(one(p, "quiet")) for p in prompts[6:]]
        return await asyncio.gather(*tasks)

    outs = asyncio.run_coroutine_threadsafe(burst(), eng._loop).result()
    noisy, quiet = outs[:6], outs[6:]
    assert quiet == ["ok", "ok"]
    refused = [o for o in noisy if isinstance(o, RequestFailedError)]
    assert len(refused) >= 4 and all(o.status_code == 429 and "share" in str(o) for o in refused)


def test_quota_holds_while_another_tenant_is_between_turns(
    tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    """Quiet's last request finished moments ago (inside ACTIVE_WINDOW_S): noisy's sequential prompts stay
    within its quota. Once the window lapses noisy is alone and may use the whole pool."""
    cfg = tenants_file(tmp_path, [{"name": "quiet", "api_keys": ["q"]},
                                  {"name": "noisy", "api_keys": ["n"], "kv_quota": 0.25}])  # fmt: skip
    eng = engine_factory(tiny_llama, max_total_tokens=2048, tenants=cfg)
    now = [1000.0]
    eng.worker.call(lambda s: setattr(s.ledger, "clock", lambda: now[0]), timeout=30)
    prompts = prompts_of([40] + [150] * 16, seed=5)
    run(eng, prompts[0], "quiet")
    for p in prompts[1:9]:
        run(eng, p, "noisy")
    held = eng.worker.call(lambda s: s.ledger.snapshot()["noisy"], timeout=30)
    assert held["kv_tokens_held"] <= held["kv_quota_tokens"] and held["quota_waits"] == 0
    now[0] += 3.0  # quiet has been idle for longer than the window
    for p in prompts[9:]:
        run(eng, p, "noisy")
    held = eng.worker.call(lambda s: s.ledger.snapshot()["noisy"], timeout=30)
    assert held["kv_tokens_held"] > held["kv_quota_tokens"]


def test_a_long_prompt_is_chunked_small_while_a_lighter_tenant_is_active(
    tiny_llama: Path, tmp_path: Path, engine_factory
) -> None:
    """Quiet finished a request moments ago (inside ACTIVE_WINDOW_S): noisy's 600-token prompt is prefilled
    in rounds of its share of CONTENDED_ROUND_TOKENS, so a quiet request arriving mid-round waits for a short
    round. Alone (the window lapsed), the same prompt is one round; the output is the same."""
    from radixrt.worker.tenant_ledger import CONTENDED_ROUND_TOKENS

    cfg = tenants_file(tmp_path, [{"name": "quiet", "api_keys": ["q"], "kv_quota": 0.4},
                                  {"name": "noisy", "api_keys": ["n"], "kv_quota": 0.3}])  # fmt: skip
    eng = engine_factory(tiny_llama, max_total_tokens=4096, tenants=cfg)
    now = [1000.0]
    rounds: list[list[tuple[str | None, int]]] = []

    def patch(s: Any) -> None:
        s.ledger.clock = lambda: now[0]
        real = s._run_extend

        def recording(batch: list[Any], mixed: list[Any]) -> None:
            rounds.append([(r.tenant, r.extend_len) for r in batch])
            real(batch, mixed)

        s._run_extend = recording

    eng.worker.call(patch, timeout=30)
    quiet, noisy = prompts_of([40, 600], seed=6)
    run(eng, quiet, "quiet")
    rounds.clear()
    contended = run(eng, noisy, "noisy")
    cap = -(-3 * CONTENDED_ROUND_TOKENS // 10)  # ceil(0.3 x 512)
    sizes = [n for r in rounds for t, n in r if t == "noisy"]
    assert sum(sizes) == 600 and max(sizes) <= cap and len(sizes) == -(-600 // cap), sizes
    assert eng.flush_cache()
    now[0] += 3.0  # quiet has been idle for longer than the window: noisy is alone
    rounds.clear()
    alone = run(eng, noisy, "noisy")
    assert [n for r in rounds for t, n in r if t == "noisy"] == [600]
    assert contended["output_ids"] == alone["output_ids"]
