"""Grammar reliability: bounded JSON strings parse strictly, the compiled-grammar cache is bounded by
bytes, constraint size is bounded, and compilation is fair between clients (429, never a timeout)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from radixrt.constrained.cache import GrammarCache, GrammarKey, entry_bytes
from radixrt.constrained.grammar import GrammarBackend, GrammarBusy, GrammarError, GrammarLimits, GrammarState
from radixrt.server.tokenizer_manager import RequestFailedError

# Bounded strings everywhere xgrammar puts them: a property, a nested object, array items, anyOf, a
# type list, and minLength alone.
BOUNDED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 10},
        "inner": {
            "type": "object",
            "properties": {"code": {"type": "string", "maxLength": 5}},
            "required": ["code"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "either": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "boolean"}]},
        "maybe": {"type": ["string", "null"], "maxLength": 3},
        "long": {"type": "string", "minLength": 3, "maxLength": 8},
    },
    "required": ["name", "inner", "tags", "either", "maybe", "long"],
}
SEEDS = range(48)
FLOOD = "(flood)"  # regexes starting with this compile only once the test opens the gate


@pytest.fixture(scope="module")
def engine(tiny_qwen2: Path) -> Iterator[Any]:
    from tests.engine_fixtures import make_engine

    eng = make_engine(
        tiny_qwen2, max_total_tokens=8192, max_grammar_bytes=2000, max_grammar_compiles_per_client=1
    )
    yield eng
    eng.check_invariant()
    eng.shutdown()


def make_backend(tiny_qwen2: Path, **limits: Any) -> GrammarBackend:
    from tests.conftest import tokenizer_for

    tok = tokenizer_for(tiny_qwen2)
    return GrammarBackend(tok, len(tok), [tok.eos_token_id], limits=GrammarLimits(**limits))


@pytest.fixture(scope="module")
def backend(tiny_qwen2: Path) -> Iterator[GrammarBackend]:
    """A backend with the default limits."""
    b = make_backend(tiny_qwen2)
    yield b
    b.shutdown()


def gate_compiles(backend: GrammarBackend) -> threading.Event:
    """Make FLOOD regexes block in their compile thread until the returned event is set."""
    gate = threading.Event()
    real: Callable[[GrammarKey], xgr.CompiledGrammar] = backend.pool.compile_fn

    def compile_fn(key: GrammarKey) -> xgr.CompiledGrammar:
        if key[1].startswith(FLOOD):
            assert gate.wait(30)
        return real(key)

    backend.pool.compile_fn = compile_fn
    return gate


def settle(backend: GrammarBackend, key: GrammarKey, client: str, deadline_s: float = 10.0) -> Any:
    """Poll like the scheduler does until ``key`` resolves (a GrammarState or a GrammarError)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        backend.collect()
        res = backend.poll(key, client)
        if res is not None:
            return res
        time.sleep(0.005)
    raise AssertionError(f"{key} did not resolve in {deadline_s}s")


# -- 1. bounded strings ---------------------------------------------------------------------------
def test_bounded_strings_parse_strictly_and_validate(engine) -> None:
    """xgrammar 0.2.9 admits raw control characters in maxLength strings (19 of these 48 outputs
    fail strict parsing without the repair); each output must parse strictly and validate."""
    params = [
        {"json_schema": json.dumps(BOUNDED_SCHEMA), "temperature": 1.0, "max_new_tokens": 160, "seed": s}
        for s in SEEDS
    ]
    outs = engine.generate(prompt=["JSON: "] * len(params), sampling_params=params)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), BOUNDED_SCHEMA)  # strict: no raw control chars


# Bounded-string contents: valid JSON (escapes, non-ASCII) and not (raw control characters, a bare
# quote or backslash, a bad escape), of the right decoded length and not.
CONTENTS = ["ab", "a\\\\b", 'a\\"b', "a\\nb", "\\u0041b", "a\\u0001", "a\\tb", "é€😀", "\\/\\/"]
CONTENTS += ["a\nb", "a\x01b", "a\tb", "abcdef", "a", 'a"b', "a\\b", "a\\q", "a\\u12"]
CONTENTS += ["", "\x01", "\\n", "\\u00e9", "é", '"', "\\"]


@pytest.mark.parametrize(("lo", "hi"), [(2, 5), (0, 1), (1, 1)])
def test_bounded_string_grammar_is_exactly_json(backend: GrammarBackend, lo: int, hi: int) -> None:
    """Grammar-level oracle: the repaired grammar accepts a bounded string iff strict JSON decodes it
    to lo..hi characters (xgrammar prints the one-character bounds inline, not as a rule)."""
    bounds = {"maxLength": hi} | ({"minLength": lo} if lo else {})
    schema = {"type": "object", "properties": {"s": {"type": "string", **bounds}}}
    key: GrammarKey = ("json", json.dumps({**schema, "required": ["s"]}))
    backend.submit(key)
    assert isinstance(settle(backend, key, "default"), GrammarState)
    for content in CONTENTS:
        text = '{"s": "' + content + '"}'
        state = backend.poll(key)
        assert isinstance(state, GrammarState)
        accepted = state.matcher.accept_string(text) and state.matcher.accept_token(
            backend.info.stop_token_ids[0]
        )
        try:
            valid = lo <= len(json.loads(text)["s"]) <= hi
        except json.JSONDecodeError:
            valid = False
        assert accepted == valid, (text, accepted, valid)


def test_bounded_string_rejects_encoded_surrogates(backend: GrammarBackend) -> None:
    """xgrammar 0.2.9's character classes match a surrogate code point encoded as 3 bytes (ED A0 80), which is
    not UTF-8 and decodes to three U+FFFD: one grammar character, three decoded ones, so maxLength broke
    (a tool call's 14-character name against maxLength 12). Real multi-byte characters still count as one."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 2}}, "required": ["s"]}
    key: GrammarKey = ("json", json.dumps(schema))
    backend.submit(key)
    assert isinstance(settle(backend, key, "default"), GrammarState)
    cases = {b"\xed\xa0\x80": False, b"a\xed\xbf\xbf": False, b"\xed\x9f\xbf": True, b"\xee\x80\x80a": True,
             "é😀".encode(): True}  # fmt: skip
    for content, expected in cases.items():
        text = b'{"s": "' + content + b'"}'
        try:
            valid = len(json.loads(text.decode("utf-8"))["s"]) <= 2
        except UnicodeDecodeError:
            valid = False
        assert valid == expected, content  # the oracle agrees with the table
        state = backend.poll(key)
        assert isinstance(state, GrammarState)
        accepted = state.matcher.accept_string(text) and state.matcher.accept_token(
            backend.info.stop_token_ids[0]
        )
        assert accepted == expected, (text, accepted)


# -- 2. bounded cache and grammar size ------------------------------------------------------------
def test_cache_is_lru_by_bytes(backend: GrammarBackend) -> None:
    compiled = backend.compiler.compile_regex("[a-z]{1,40}")
    keys: list[GrammarKey] = [("regex", f"k{i}") for i in range(4)]
    size = entry_bytes(keys[0], compiled)
    assert size == compiled.memory_size_bytes + 2 and compiled.memory_size_bytes > 1000
    cache = GrammarCache(3 * size)
    for key in keys[:3]:
        assert cache.put(key, compiled)
    assert cache.get(keys[0]) is compiled  # now the most recently used
    assert cache.put(keys[3], compiled)
    assert keys[1] not in cache and all(k in cache for k in (keys[0], keys[2], keys[3]))
    assert cache.evictions == 1 and cache.bytes == 3 * size
    cache.check()
    assert not GrammarCache(size - 1).put(keys[0], compiled)  # larger than the whole cache: not kept


def test_many_distinct_regexes_stay_within_the_cache_bound(backend: GrammarBackend, tiny_qwen2: Path) -> None:
    probe = backend.compiler.compile_regex("[a-z]{1,9}x")
    limit = 4 * probe.memory_size_bytes
    small = make_backend(tiny_qwen2, cache_bytes=limit)
    for k in range(1, 25):
        key: GrammarKey = ("regex", f"[a-z]{{1,{k}}}x")
        small.submit(key)
        state = settle(small, key, "default")
        assert isinstance(state, GrammarState)  # delivered even when it is evicted later
        small.cache.check()
        held = sum(c.memory_size_bytes for c, _ in small.cache.entries.values())
        assert small.cache.bytes <= limit and held <= limit
    assert small.cache.evictions > 0 and 0 < len(small.cache) < 24
    assert ("regex", "[a-z]{1,24}x") in small.cache  # the most recent stays
    small.shutdown()


def test_too_large_constraint_is_refused(engine, backend: GrammarBackend) -> None:
    with pytest.raises(GrammarError, match=r"^regex: .*--max-grammar-bytes"):
        backend.submit(("regex", "a" * (backend.limits.max_grammar_bytes + 1)))
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(200)}}
    with pytest.raises(ValueError, match=r"^json_schema: the constraint is \d+ bytes, above .* 2000"):
        engine.generate(prompt="x", sampling_params={"json_schema": json.dumps(big)})
    assert engine.generate(prompt="x", sampling_params={"regex": "(ok)"})["text"] == "ok"


# -- 3. bounded, fair compilation -----------------------------------------------------------------
def test_flooding_client_is_refused_and_does_not_starve_another(tiny_qwen2: Path) -> None:
    backend = make_backend(
        tiny_qwen2, compile_threads=2, compiles_per_client=3, compile_timeout_s=1.0, reserve_thread=True
    )
    gate = gate_compiles(backend)
    flood: list[GrammarKey] = [("regex", f"{FLOOD}{i}") for i in range(3)]
    for key in flood:
        backend.submit(key, "a")
    with pytest.raises(GrammarBusy, match="too many grammar compilations in flight for client 'a'"):
        backend.submit(("regex", f"{FLOOD}x"), "a")
    assert GrammarBusy.status_code == 429
    end = time.monotonic() + 10
    while backend.pool.running.get("a", 0) < backend.pool.client_threads and time.monotonic() < end:
        time.sleep(0.005)  # the flood holds every thread it may take
    t0 = time.monotonic()
    innocent: GrammarKey = ("regex", "(yes|no|perhaps)")
    backend.submit(innocent, "b")  # another client is not refused
    assert isinstance(settle(backend, innocent, "b"), GrammarState)
    assert time.monotonic() - t0 < 1.0  # compiled on the thread the flood may not take
    # The running flood job times out from its start; the queued ones have not started, so they wait.
    first = settle(backend, flood[0], "a")
    assert isinstance(first, GrammarError) and "took longer than 1s" in str(first)
    time.sleep(0.2)
    backend.collect()
    assert backend.poll(flood[1], "a") is None and backend.poll(flood[2], "a") is None
    assert backend.pool.in_flight("a") == 3  # the timed-out compile still holds its slot
    with pytest.raises(GrammarBusy):
        backend.submit(("regex", f"{FLOOD}y"), "a")
    gate.set()  # the abandoned compile returns; the queued ones start now and finish in time
    assert isinstance(settle(backend, flood[1], "a"), GrammarState)
    assert isinstance(settle(backend, flood[2], "a"), GrammarState)
    assert backend.pool.in_flight("a") == 0
    backend.shutdown()


def test_engine_refuses_a_compile_over_the_client_share_with_429(engine) -> None:
    backend = engine.worker.call(lambda s: s.grammars.backend)
    gate = gate_compiles(backend)
    assert engine.generate(prompt="x", sampling_params={"regex": "(yes|no|perhaps)"})["text"]
    result: dict[str, Any] = {}
    slow = threading.Thread(
        target=lambda: result.update(engine.generate(prompt="x", sampling_params={"regex": f"{FLOOD}a"}))
    )
    slow.start()
    try:
        end = time.monotonic() + 10
        while backend.pool.in_flight("default") < 1 and time.monotonic() < end:
            time.sleep(0.01)
        with pytest.raises(RequestFailedError, match="too many grammar compilations in flight") as err:
            engine.generate(prompt="x", sampling_params={"regex": f"{FLOOD}b"})
        assert err.value.status_code == 429
        # A cached grammar needs no compilation: the same client is served meanwhile.
        again = engine.generate(prompt="x", sampling_params={"regex": "(yes|no|perhaps)"})
        assert again["text"] in ("yes", "no", "perhaps")
    finally:
        gate.set()
        slow.join(30)
    assert result["text"] == "flooda"
