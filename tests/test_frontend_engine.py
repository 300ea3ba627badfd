"""frontend_lang on the in-process Engine: gen, select (against logprobs computed directly), the
choices methods, streaming, constraints, and the cached-token counts of fork / run_batch / select."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from frontend_util import (
    CHOICES,
    QUESTION,
    check_fork_cache,
    check_run_batch_cache,
    check_select_cache,
    check_stop_strings,
    cont,
    pick,
)

import frontend_lang as sgl
from frontend_lang.ir import DTYPE_REGEX

pytest_plugins = ["frontend_fixtures"]


def _direct(backend: sgl.EngineBackend) -> tuple[list[list[float]], list[list[float | None]]]:
    """Oracle: each choice's token logprobs from its own Engine.generate call (prompt logprobs from
    the prefix boundary), and the same tokens scored with no prompt."""
    eng, tok = backend.engine, backend.tokenizer
    prefix = tok.encode(QUESTION)
    cond, uncond = [], []
    for choice in CHOICES:
        ids = tok.encode(QUESTION + choice)
        assert ids[: len(prefix)] == prefix  # the choices tokenize apart from the prefix
        out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                           logprob_start_len=len(prefix))  # fmt: skip
        cond.append([e[0] for e in out["meta_info"]["input_token_logprobs"]])
        out = eng.generate(input_ids=ids[len(prefix) :], sampling_params={"max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=0)  # fmt: skip
        uncond.append([e[0] for e in out["meta_info"]["input_token_logprobs"]])
    return cond, uncond


def _greedy_reference(rows: list[list[float]]) -> int:
    width = max(len(r) for r in rows)
    padded = [r + [sum(r) / len(r)] * (width - len(r)) for r in rows]
    alive = list(range(len(rows)))
    for j in range(width):
        best = max(padded[i][j] for i in alive)
        alive = [i for i in alive if padded[i][j] == pytest.approx(best, abs=1e-5)]
    return alive[0]


def test_select_methods_match_direct_logprobs(fl_backend: sgl.EngineBackend) -> None:
    cond, uncond = _direct(fl_backend)
    means = [sum(r) / len(r) for r in cond]
    lifts = [
        sum(c - (u or 0.0) for c, u in zip(cr, ur, strict=True)) / len(cr)
        for cr, ur in zip(cond, uncond, strict=True)
    ]
    expected = {
        "token_length_normalized": max(range(len(CHOICES)), key=lambda i: means[i]),
        "greedy_token_selection": _greedy_reference(cond),
        "unconditional_likelihood_normalized": max(range(len(CHOICES)), key=lambda i: lifts[i]),
    }
    for method, want in expected.items():
        s = pick.run(method=method, backend=fl_backend)
        assert s.error() is None, s.error()
        meta = s.get_meta_info("c")
        assert s["c"] == CHOICES[want], (method, meta["scores"])
        assert s.text() == QUESTION + CHOICES[want]
        assert meta["choices_method"] == method
        for got, ref in zip(meta["input_token_logprobs"], cond, strict=True):
            assert got == pytest.approx(ref, abs=1e-4)
        assert meta["normalized_prompt_logprobs"] == pytest.approx(means, abs=1e-4)
        if method == "unconditional_likelihood_normalized":
            assert meta["scores"] == pytest.approx(lifts, abs=1e-4)
            assert [u[0] for u in meta["unconditional_token_logprobs"]] == [None] * len(CHOICES)


def test_gen_with_stop_strings(fl_backend: sgl.EngineBackend) -> None:
    check_stop_strings(fl_backend)


def test_select_is_one_batched_request_and_computes_the_prefix_once(fl_backend: sgl.EngineBackend) -> None:
    check_select_cache(fl_backend)


def test_fork_commits_the_prefix_once(fl_backend: sgl.EngineBackend) -> None:
    check_fork_cache(fl_backend)


def test_run_batch_precaches_the_traced_prefix(fl_backend: sgl.EngineBackend) -> None:
    check_run_batch_cache(fl_backend)


def test_streaming_from_the_engine(fl_backend: sgl.EngineBackend) -> None:
    s = cont.run(stops=None, stream=True, backend=fl_backend)
    chunks = list(s.text_iter("x"))
    assert len(chunks) > 1 and "".join(chunks) == s["x"]
    assert "".join(cont.run(stops=None, stream=True, backend=fl_backend).text_iter()) == QUESTION + s["x"]


def test_constraints_are_passed_to_the_runtime(fl_backend: sgl.EngineBackend) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}

    @sgl.function
    def typed(s: Any) -> None:
        s += "Number: " + sgl.gen_int("i", max_tokens=8)
        s += " Flag: " + sgl.gen("b", dtype=bool, max_tokens=4)
        s += " Name: " + sgl.gen_string("w", max_tokens=12)
        s += " JSON: " + sgl.gen("j", json_schema=schema, max_tokens=32)

    s = typed.run(temperature=0.7, backend=fl_backend)
    assert s.error() is None, s.error()
    for name, kind in (("i", "int"), ("b", "bool")):
        assert re.fullmatch(DTYPE_REGEX[kind], s[name]), (name, s[name])
    assert (
        re.fullmatch(DTYPE_REGEX["str"], s["w"]) or s.get_meta_info("w")["finish_reason"]["type"] == "length"
    )
    assert isinstance(json.loads(s["j"])["ok"], bool)

    @sgl.function
    def bad(s: Any) -> None:
        s += "x" + sgl.gen("y", regex="(unclosed", max_tokens=4)

    err = bad.run(backend=fl_backend).error()
    assert isinstance(err, sgl.BackendError) and "regex" in str(err)


def test_runtime_errors_and_n(fl_backend: sgl.EngineBackend) -> None:
    @sgl.function
    def prog(s: Any, p: float, n: int) -> None:
        s += "Hello" + sgl.gen("x", max_tokens=3, top_p=p, n=n)

    err = prog.run(p=5.0, n=1, backend=fl_backend).error()
    assert isinstance(err, ValueError) and "top_p" in str(err)
    s = prog.run(p=1.0, n=2, backend=fl_backend)
    assert s.error() is None and isinstance(s["x"], list) and len(s["x"]) == 2 and s.text() == "Hello"
