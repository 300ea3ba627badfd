"""benchmarks/tool_loop.py's arithmetic: the two cache optima against a hand-computed trace, and the call
check against jsonschema on calls that do and do not validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from benchmarks.tool_loop import SCHEMAS, check_call, optima


def test_optima_match_a_hand_computed_trace() -> None:
    prompts = [
        [1, 2, 3, 4],  # first: nothing before it
        [1, 2, 9, 9, 9],  # another program: shares [1, 2] with prompt 0
        [1, 2, 3, 4, 5, 6, 7, 8],  # prompt 0's next turn; prompt 0 wrote 3 tokens
        [1, 2, 3, 4],  # a repeat of prompt 0: capped at all but its last token (3)
        [1, 2, 9, 9, 9, 1, 1],  # prompt 1's next turn; prompt 1 wrote 10 tokens, capped at 6
    ]
    previous = [None, None, 0, None, 1]
    completions = [3, 10, 0, 0, 0]
    # exact:  0 + 2 + 4 + 3 + 5 = 14; with outputs: 0 + 2 + min(4 + 3, 7) + 3 + min(5 + 10, 6) = 18
    assert optima(prompts, previous, completions) == (14, 18)


def test_the_benchmark_schemas_are_valid_json_schemas() -> None:
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


GOOD = {"room": {"floor": 3, "name": "lab"}, "target": 21.5, "schedule": {"start": {"hour": 7, "minute": 0}}}


@pytest.mark.parametrize(
    ("name", "arguments", "allowed", "problem"),
    [
        ("set_thermostat", json.dumps(GOOD), {"set_thermostat"}, None),
        ("set_thermostat", json.dumps({**GOOD, "target": 30.5}), {"set_thermostat"}, "do not validate"),
        ("set_thermostat", json.dumps({"target": 20}), {"set_thermostat"}, "do not validate"),
        ("set_thermostat", '{"room": {"floor": 3', {"set_thermostat"}, "do not parse"),
        ("set_thermostat", json.dumps(GOOD), {"send_email"}, "not in"),
    ],
)
def test_check_call(name: str, arguments: str, allowed: set[str], problem: str | None) -> None:
    got = check_call(name, arguments, allowed)
    assert got is None if problem is None else got is not None and problem in got
