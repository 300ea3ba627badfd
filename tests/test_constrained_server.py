"""Structured generation through the server: /generate with regex and OpenAI response_format."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
from server_harness import ServerProcess

pytest_plugins = ["server_fixtures"]

DATE = r"\d{4}-(0[1-9]|1[0-2])-[0-3]\d"
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "reasons": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["answer", "confidence"],
}


def test_generate_regex_batch(server: ServerProcess) -> None:
    with server.client() as c:
        body = {
            "text": ["Date: "] * 6,
            "sampling_params": [
                {"regex": DATE, "temperature": 1.0, "seed": s, "max_new_tokens": 30} for s in range(6)
            ],
        }
        r = c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        for out in r.json():
            assert re.fullmatch(DATE, out["text"]), out["text"]


def test_chat_response_format_json_schema(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        for seed in range(4):
            resp = client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "Is it raining? Answer in JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                temperature=1.0,
                seed=seed,
                max_tokens=120,
            )
            content = resp.choices[0].message.content
            assert content is not None
            jsonschema.validate(json.loads(content), SCHEMA)
        resp = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "JSON please"}],
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=1,
            max_tokens=200,
            extra_body={"ignore_eos": False},
        )
        if resp.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)


def test_bad_constraints_are_400(server: ServerProcess) -> None:
    with server.client() as c:
        r = c.post("/generate", json={"text": "x", "sampling_params": {"regex": "(unclosed"}})
        assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "m", "prompt": "x", "regex": "[z-a]"})
        assert r.status_code == 400
        r = c.post("/generate", json={"text": "x", "sampling_params": {"json_schema": "{oops"}})
        assert r.status_code == 400 and "json_schema" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200
