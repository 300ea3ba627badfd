"""Tenants over HTTP: API keys -> tenants (401 / 403), no cache hit across tenants under any salt a client
can send, per-tenant Prometheus series, ``--cache-report-granularity``, and no usable TTFT side channel
across tenants (while within a tenant the cache speed-up stays)."""

from __future__ import annotations

import json
import random
import re
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, wait_idle

from radixrt.config.server_args import ServerArgs
from radixrt.config.tenants import ADMIN_TENANT, namespace
from radixrt.server.http.context import ServerContext
from radixrt.server.http.metrics import TENANT_SERIES
from radixrt.server.http.tenants import report_cached

pytest_plugins = ["server_fixtures"]

ADMIN = "sk-admin"
KEYS = {"alpha": "sk-alpha", "beta": "sk-beta", "gamma": "sk-gamma"}
TENANTS = [{"name": name, "api_keys": [key]} for name, key in KEYS.items()]
ONE = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
# Every kind of salt a client could send to reach another tenant's cache (or leave its own).
SALTS: list[str | None] = [
    None, "", "alpha", "beta", ADMIN_TENANT, "tenant", json.dumps(["tenant", "alpha", None]),
    namespace("alpha", ""), namespace("alpha", "x"), '["tenant","alpha",null]',
    '["tenant", "alpha"]', '{"tenant": "alpha"}', "alpha\x00", "\x00", "\u00e5lpha \u2603 \U0001f680",
    "a" * 5000,
]  # fmt: skip
# Long enough that a full prefill clearly outweighs the fixed cost of a request (HTTP, scheduling) on a
# fast machine too: at 512 tokens a CI machine prefilled in 56 ms against 36 ms for a cached repeat.
SIDE_CHANNEL_LEN = 1536
ADMIN_ROUTES = [("GET", "/get_server_info"), ("GET", "/server_info"), ("GET", "/metrics"),
                ("GET", "/get_load"), ("GET", "/health_generate"), ("POST", "/flush_cache"),
                ("GET", "/no/such/admin/route")]  # fmt: skip


def ids_of(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 8000) for _ in range(n)]


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="module")
def servers(
    server_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    """Two servers with the same tenants, started together: cached_tokens reported ``exact`` and ``page``."""
    d = tmp_path_factory.mktemp("tenants_http")
    (d / "tenants.json").write_text(json.dumps({"tenants": TENANTS}))
    flags = ["--max-total-tokens", "32768", "--tenants", str(d / "tenants.json")]
    procs = {
        g: ServerProcess(
            server_model, d / f"{g}.log", [*flags, "--cache-report-granularity", g], ADMIN, cli=False
        )
        for g in ("exact", "page")
    }
    try:
        for srv in procs.values():
            srv.wait_ready()
        yield procs
    finally:
        with ThreadPoolExecutor() as pool:  # both at once: each takes seconds to drain and stop
            list(pool.map(ServerProcess.stop, procs.values()))


def cached(srv: ServerProcess, key: str, ids: list[int], salt: str | None, route: str = "/generate") -> int:
    """One request for ``ids`` with ``salt`` as the holder of ``key``: its reported cached_tokens."""
    if route == "/generate":
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": ONE, "cache_salt": salt}
    else:
        body = {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
    r = httpx.post(srv.url + route, json=body, headers=headers(key), timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    return int(out["meta_info"]["cached_tokens"] if route == "/generate" else out["usage"]["prompt_tokens_details"]["cached_tokens"])  # fmt: skip


def test_keys_name_tenants_and_admin_routes_need_the_admin_key(servers: dict[str, ServerProcess]) -> None:
    srv = servers["exact"]
    gen = {"text": "hello", "sampling_params": ONE}
    for method, route in [("POST", "/generate"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                          *ADMIN_ROUTES]:  # fmt: skip
        for key in (None, "wrong", KEYS["alpha"] + "x", ADMIN[:-1]):
            r = httpx.request(method, srv.url + route, json=gen, headers=headers(key))
            assert r.status_code == 401, (route, key, r.text)
            assert (
                r.json()["error"]["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
            )
    for method, route in ADMIN_ROUTES:
        r = httpx.request(method, srv.url + route, headers=headers(KEYS["beta"]))
        assert r.status_code == 403, (route, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "permission_error"
        assert error["code"] == "admin_key_required" and "admin key" in error["message"]
        if route != "/no/such/admin/route":
            assert (
                httpx.request(method, srv.url + route, headers=headers(ADMIN), timeout=60).status_code == 200
            )
    assert httpx.get(srv.url + "/health").status_code == 200
    for route in (
        "/v1/models",
        "/model_info",
        "/get_model_info",
        f"/v1/models/{srv.info['served_model_name']}",
    ):
        assert httpx.get(srv.url + route, headers=headers(KEYS["alpha"])).status_code == 200, route
    # the tenant comes from the key, never from the body
    r = httpx.post(srv.url + "/generate", json={**gen, "tenant": "beta"}, headers=headers(KEYS["alpha"]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
    with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS["alpha"], max_retries=0) as oc:
        assert oc.completions.create(model="m", prompt="hi", max_tokens=2).usage.completion_tokens == 2  # type: ignore[union-attr]
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-nobody", max_retries=0) as oc:
        with pytest.raises(openai.AuthenticationError):
            oc.models.list()


def test_no_salt_reaches_another_tenants_cache(servers: dict[str, ServerProcess]) -> None:
    """alpha caches the prompt under every salt; beta then sends it under every salt (via /generate and
    /v1/completions): never a hit; beta's own repeat is a hit, so its cache works. Chat too, streamed."""
    srv = servers["exact"]
    rng = random.Random(13)
    prompt = ids_of(48, rng)
    assert len(set(SALTS)) == len(SALTS)
    for salt in SALTS:
        assert cached(srv, KEYS["alpha"], prompt, salt) == 0, salt  # a salt subdivides alpha's namespace
        assert cached(srv, KEYS["alpha"], prompt, salt) == 47, salt
    for i, salt in enumerate(SALTS):
        route = ("/generate", "/v1/completions")[i % 2]
        assert cached(srv, KEYS["beta"], prompt, salt, route) == 0, (salt, route)
        assert cached(srv, KEYS["beta"], prompt, salt, route) == 47, (salt, route)
    for salt in SALTS[:6]:  # the admin key has a namespace of its own too
        assert cached(srv, ADMIN, prompt, salt) == 0, salt
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "the secret pin is 4711"}],
        "max_tokens": 1,
    }
    usage = []
    for key, stream in [("alpha", False), ("alpha", False), ("gamma", False), ("gamma", True)]:
        body = {**chat, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
        with httpx.Client(base_url=srv.url, headers=headers(KEYS[key]), timeout=60) as c:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            if stream:
                events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                assert events[-1] == "[DONE]"
                usage.append(json.loads(events[-2])["usage"])
            else:
                usage.append(r.json()["usage"])
    n = usage[0]["prompt_tokens"]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [0, n - 1, 0, n - 1]
    with httpx.Client(base_url=srv.url, headers=headers(ADMIN), timeout=60) as c:
        wait_idle(c)


def test_per_tenant_series(servers: dict[str, ServerProcess]) -> None:
    """gamma alone sends a known mix (native, streamed, a batch, completions): its series add up to what
    the answers said; every per-tenant series exists for every tenant (and the admin)."""
    srv = servers["exact"]
    rng = random.Random(7)
    a, b = ids_of(40, rng), ids_of(24, rng)
    before = scrape(srv)
    metas: list[dict[str, Any]] = []
    with httpx.Client(base_url=srv.url, headers=headers(KEYS["gamma"]), timeout=60) as c:
        params = {**ONE, "max_new_tokens": 3}
        metas.append(
            c.post("/generate", json={"input_ids": a, "sampling_params": params}).json()["meta_info"]
        )
        r = c.post("/generate", json={"input_ids": a, "sampling_params": params, "stream": True})
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        metas.append(json.loads(events[-2])["meta_info"])
        batch = c.post("/generate", json={"input_ids": [a, b], "sampling_params": params}).json()
        metas += [item["meta_info"] for item in batch]
        u = c.post(
            "/v1/completions", json={"model": "m", "prompt": b, "max_tokens": 2, "temperature": 0}
        ).json()
        metas.append({"prompt_tokens": u["usage"]["prompt_tokens"], "completion_tokens": u["usage"]["completion_tokens"],
                      "cached_tokens": u["usage"]["prompt_tokens_details"]["cached_tokens"]})  # fmt: skip
    with httpx.Client(base_url=srv.url, headers=headers(ADMIN), timeout=60) as c:
        wait_idle(c)
    after = scrape(srv)

    def delta(name: str, tenant: str = "gamma") -> float:
        return after[(name, tenant)] - before.get((name, tenant), 0.0)

    assert delta("radixrt:tenant_requests_total") == len(metas) == 5
    assert delta("radixrt:tenant_prompt_tokens_total") == sum(m["prompt_tokens"] for m in metas)
    assert delta("radixrt:tenant_cached_tokens_total") == sum(m["cached_tokens"] for m in metas) > 0
    assert delta("radixrt:tenant_generation_tokens_total") == sum(m["completion_tokens"] for m in metas)
    assert delta("radixrt:tenant_time_to_first_token_seconds_count") == 5
    assert delta("radixrt:tenant_e2e_request_latency_seconds_count") == 5
    assert delta("radixrt:tenant_evicted_tokens_total") == delta("radixrt:tenant_quota_waits_total") == 0
    hit = (
        after[("radixrt:tenant_cached_tokens_total", "gamma")]
        / after[("radixrt:tenant_prompt_tokens_total", "gamma")]
    )
    assert after[("radixrt:tenant_cache_hit_rate", "gamma")] == pytest.approx(hit)
    total = srv.info["max_total_num_tokens"]
    assert after[("radixrt:tenant_kv_quota_tokens", "gamma")] == int(0.5 * total)
    assert 0 < after[("radixrt:tenant_kv_held_tokens", "gamma")] <= int(0.5 * total)  # its cached prompts
    for tenant in (*KEYS, ADMIN_TENANT):  # the admin's requests: the warm-up, the checks above
        for name in TENANT_SERIES:
            sample = name + "_count" if name.endswith("_seconds") else name
            assert (sample, tenant) in after, (sample, tenant)


def scrape(srv: ServerProcess) -> dict[tuple[str, str], float]:
    """/metrics (admin key): every sample that has a ``tenant`` label, by (sample name, tenant)."""
    text = httpx.get(srv.url + "/metrics", headers=headers(ADMIN), timeout=30).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "tenant" in s.labels:
                out[(s.name, s.labels["tenant"])] = s.value
    return out


def test_cache_report_granularity(servers: dict[str, ServerProcess]) -> None:
    """``page``: a tenant sees cached_tokens in whole 16-token pages (native, OpenAI, streamed); the admin
    sees the exact count. ``none`` reports 0; an unknown choice is refused."""
    srv = servers["page"]
    rng = random.Random(5)
    prompt = ids_of(48, rng)
    assert cached(srv, KEYS["alpha"], prompt, None) == 0
    assert cached(srv, KEYS["alpha"], prompt, None) == 32  # 47 cached: two whole pages
    assert cached(srv, KEYS["alpha"], prompt, None, "/v1/completions") == 32
    r = httpx.post(srv.url + "/generate", json={"input_ids": prompt, "sampling_params": ONE, "stream": True},
                   headers=headers(KEYS["alpha"]), timeout=60)  # fmt: skip
    snapshots = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    assert snapshots and all(s["meta_info"]["cached_tokens"] == 32 for s in snapshots)
    assert cached(srv, ADMIN, prompt, None) == 0 and cached(srv, ADMIN, prompt, None) == 47
    result = {
        "meta_info": {"cached_tokens": 47, "cached_tokens_details": {"device": 47, "host": 0, "disk": 0}}
    }
    assert report_cached([json.loads(json.dumps(result))], "none")[0]["meta_info"] == {"cached_tokens": 0}
    assert report_cached(result, "page")["meta_info"] == {"cached_tokens": 32}
    with pytest.raises(ValueError, match="cache_report_granularity"):
        ServerArgs(cache_report_granularity="rounded")


def test_no_timing_side_channel_across_tenants(servers: dict[str, ServerProcess]) -> None:
    """alpha sends a long prompt; beta's TTFT for that same prompt is that of a fresh prompt of the same
    length (both full prefills), while alpha's own repeat is clearly faster: medians over repetitions.

    A leak fails every round (beta's TTFT would be alpha's cached one); a load burst from other work on
    a shared 2-core machine can spoil one round of a few seconds, so up to three rounds are measured."""
    srv = servers["exact"]
    rng = random.Random(21)
    rounds = []
    for _ in range(3):
        cross, fresh, own = [], [], []
        for rep in range(6):
            secret, other = ids_of(SIDE_CHANNEL_LEN, rng), ids_of(SIDE_CHANNEL_LEN, rng)
            assert ttft(srv, KEYS["alpha"], secret)[1] == 0
            pair = [(cross, secret), (fresh, other)]
            for sink, ids in pair if rep % 2 else pair[::-1]:
                seconds, hit = ttft(srv, KEYS["beta"], ids)
                assert hit == 0
                sink.append(seconds)
            seconds, hit = ttft(srv, KEYS["alpha"], secret)
            assert hit == SIDE_CHANNEL_LEN - 1
            own.append(seconds)
        c, f, o = statistics.median(cross), statistics.median(fresh), statistics.median(own)
        rounds.append(f"cross-tenant {c:.3f}s, fresh {f:.3f}s, own repeat {o:.3f}s")
        if c >= 0.7 * f and o <= 0.5 * f:
            return
    pytest.fail("median TTFTs per round: " + "; ".join(rounds))


def ttft(srv: ServerProcess, key: str, ids: list[int]) -> tuple[float, int]:
    """Seconds from sending a streamed request to its first event, as the client sees them, and the
    request's cached_tokens."""
    body = {"input_ids": ids, "sampling_params": ONE, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", srv.url + "/generate", json=body, headers=headers(key), timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        elapsed = time.perf_counter() - start
        for _ in lines:
            pass
    out = json.loads(first[6:])
    assert out["output_ids"], first
    return elapsed, int(out["meta_info"]["cached_tokens"])


@pytest.mark.parametrize(
    ("doc", "api_key", "error"),
    [
        ({"tenants": [{"name": "a", "api_keys": ["k"]}]}, None, "--tenants needs --api-key"),
        ({"tenants": [{"name": "a", "api_keys": [ADMIN]}]}, ADMIN, "--api-key is also a key of tenant 'a'"),
        (None, ADMIN, "tenants: cannot read"),
        ({"tenants": [{"name": "a", "api_keys": ["k"]}], "x": 1}, ADMIN, 'expected an object {"tenants"'),
    ],
    ids=["no-admin-key", "admin-key-is-a-tenant-key", "missing-file", "not-the-schema"],
)
def test_tenants_are_checked_before_the_worker_starts(
    doc: Any, api_key: str | None, error: str, server_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "tenants.json"
    if doc is not None:
        path.write_text(json.dumps(doc))
    args = ServerArgs(model_path=str(server_model), api_key=api_key, tenants=str(path))
    with pytest.raises(ValueError, match=re.escape(error)):
        ServerContext.start(args)


def test_bad_tenants_file_fails_startup(server_model: Path, tmp_path: Path) -> None:
    """The server exits 1 at once, its log naming the field."""
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "a", "api_keys": ["k"], "kv_quota": 2}]}))
    srv = ServerProcess(server_model, tmp_path / "server.log", ["--tenants", str(path)], ADMIN, cli=False)
    try:
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert "startup failed: tenants[0].kv_quota: must be in (0, 1], got 2" in log, log[-2000:]
