"""Structured generation: every constrained output matches its regex / validates against its schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

SEEDS = range(8)
REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",
    r"\d{4}-(0[1-9]|1[0-2])-[0-3]\d",
    r"(yes|no|maybe)",
    r"[a-z]{3,8}@[a-z]{3,6}\.(com|org)",
    r"-?(0|[1-9]\d{0,5})(\.\d{1,3})?",
]
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 8},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "population": {"type": "integer", "minimum": 1},
                },
                "required": ["name", "population"],
            },
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["city", "tags", "ok"],
    },
    {
        "type": "object",
        "properties": {
            "kind": {"enum": ["circle", "square"]},
            "size": {"type": "number", "minimum": -5, "maximum": 5},
            "points": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 4,
            },
        },
        "required": ["kind", "size", "points"],
    },
]


@pytest.fixture(scope="module")
def engine(tiny_qwen2: Path):
    from tests.engine_fixtures import make_engine

    eng = make_engine(tiny_qwen2, max_total_tokens=8192)
    yield eng
    eng.check_invariant()
    eng.shutdown()


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(engine, pattern: str) -> None:
    params = [{"regex": pattern, "temperature": 1.0, "max_new_tokens": 40, "seed": s} for s in SEEDS]
    outs = engine.generate(prompt=["Answer: "] * len(params), sampling_params=params)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(pattern, out["text"]), out["text"]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("jump_forward", [True, False])
def test_json_schema_outputs_validate(engine, schema: dict, jump_forward: bool) -> None:
    engine.worker.call(lambda s: setattr(s.args, "disable_jump_forward", not jump_forward))
    before = engine.get_server_info()["jump_forward_tokens"]
    params = [
        {"json_schema": json.dumps(schema), "temperature": 1.0, "max_new_tokens": 160, "seed": s}
        for s in SEEDS
    ]
    outs = engine.generate(prompt=["Give me JSON: "] * len(params), sampling_params=params)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)
    jumped = engine.get_server_info()["jump_forward_tokens"] - before
    assert (jumped > 0) == jump_forward
    engine.worker.call(lambda s: setattr(s.args, "disable_jump_forward", False))


def test_ebnf_grammar(engine) -> None:
    grammar = 'root ::= "answer: " choice "." \nchoice ::= "yes" | "no" | "it depends"'
    outs = engine.generate(
        prompt=["Q: is it? "] * 6,
        sampling_params=[{"ebnf": grammar, "max_new_tokens": 20, "seed": s} for s in range(6)],
    )
    for out in outs:
        assert re.fullmatch(r"answer: (yes|no|it depends)\.", out["text"]), out["text"]


def test_constrained_and_free_rows_in_one_batch(engine, tiny_qwen2: Path) -> None:
    free_ids = prompts_of([18], seed=40)[0]
    free = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    outs = engine.generate(
        input_ids=[free_ids, engine.tokenizer.encode("Date: "), free_ids],
        sampling_params=[free, {"regex": REGEXES[1], "temperature": 1.0, "seed": 3}, {**free, "n": 1}],
    )
    ref = hf_greedy(tiny_qwen2, free_ids, 10)
    assert outs[0]["output_ids"] == ref and outs[2]["output_ids"] == ref
    assert re.fullmatch(REGEXES[1], outs[1]["text"])


def test_n_samples_each_constrained(engine) -> None:
    outs = engine.generate(prompt="Phone: ", sampling_params={"regex": REGEXES[0], "n": 4, "seed": 9})
    assert len(outs) == 4
    assert all(re.fullmatch(REGEXES[0], o["text"]) for o in outs)
    assert len({o["text"] for o in outs}) > 1


def test_constrained_under_retraction_and_chunking(tiny_qwen2: Path) -> None:
    from tests.engine_fixtures import make_engine

    eng = make_engine(tiny_qwen2, max_total_tokens=160, chunked_prefill_size=16)
    try:
        prompts = prompts_of([40, 35, 45], seed=41)
        outs = eng.generate(
            input_ids=prompts,
            sampling_params={"json_schema": json.dumps(SCHEMAS[2]), "max_new_tokens": 60, "seed": 1},
        )
        for out in outs:
            jsonschema.validate(json.loads(out["text"]), SCHEMAS[2])
        eng.check_invariant()
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"regex": "(unclosed"}, "regex"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": json.dumps({"type": "frobnicate"})}, "json_schema"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ({"regex": "a", "json_schema": "{}"}, "regex"),
    ],
)
def test_bad_constraints_raise(engine, params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        engine.generate(prompt="x", sampling_params=params)
    assert (
        engine.generate(prompt="x", sampling_params={"max_new_tokens": 2})["meta_info"]["completion_tokens"]
        == 2
    )


def test_slow_grammar_compilation_is_aborted(tiny_qwen2: Path) -> None:
    from tests.engine_fixtures import make_engine

    eng = make_engine(tiny_qwen2, grammar_compile_timeout=1e-6)
    try:
        props = {
            f"field_number_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 5 + 1}}}x"} for i in range(60)
        }
        schema = {"type": "object", "properties": props, "required": list(props)}
        with pytest.raises(ValueError, match="json_schema: grammar compilation took longer than"):
            eng.generate(prompt="x", sampling_params={"json_schema": json.dumps(schema)})
        eng.check_invariant()
    finally:
        eng.shutdown()
