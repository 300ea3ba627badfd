"""--reasoning-parser on a live server, read with the official ``openai`` client.

The tiny random-weight model never writes ``</think>`` on its own, so the checks use what it does write:
with deepseek-r1, and with qwen3 under a chat template whose generation prompt opens ``<think>``, the
output is all reasoning. The oracle is the parser applied to the same greedy request's unsplit text
(``separate_reasoning: false``); streamed deltas must reassemble to the non-streamed message. The split of
outputs that do close their reasoning is covered in test_reasoning_parser.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_harness import ServerProcess, wait_idle

from radixrt.config.server_args import ServerArgs
from radixrt.server.reasoning_parser import FORMATS, split

pytest_plugins = ["server_fixtures"]

OPENS_THINK = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12}


def _with_template(model: Path, out: Path, template: str) -> Path:
    """A copy of ``model`` whose chat template is ``template``."""
    shutil.copytree(model, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=["deepseek-r1", "qwen3-opened"])
def srv(
    request: pytest.FixtureRequest, server_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ServerProcess]]:
    d = tmp_path_factory.mktemp("reasoning")
    model = server_model
    parser = str(request.param).removesuffix("-opened")
    if request.param == "qwen3-opened":
        model = _with_template(server_model, d / "model", OPENS_THINK)
    flags = ["--max-total-tokens", "4096", "--disable-compile", "--reasoning-parser", parser]
    if parser == "deepseek-r1":  # the other server is the baseline without it
        flags.append("--strip-thinking-cache")
    proc = ServerProcess(model, d / "server.log", flags, None, cli=False)
    try:
        proc.wait_ready()
        yield str(request.param), proc
    finally:
        proc.stop()


@pytest.fixture
def client(srv: tuple[str, ServerProcess]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv[1].url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def _messages() -> list[Any]:
    return [{"role": "user", "content": f"Think about {uuid.uuid4().hex}, then answer."}]


def test_reasoning_content_matches_the_parser(srv: tuple[str, ServerProcess], client: openai.OpenAI) -> None:
    name, _ = srv
    messages = _messages()
    raw = client.chat.completions.create(
        model="m", messages=messages, extra_body={"separate_reasoning": False}, **GREEDY
    )
    text = raw.choices[0].message.content or ""
    assert "reasoning_content" not in (raw.choices[0].message.model_extra or {})
    want = split(FORMATS[name.removesuffix("-opened")], text, opened=True)
    got = client.chat.completions.create(model="m", messages=messages, **GREEDY).choices[0].message
    assert (got.model_extra or {})["reasoning_content"] == want.reasoning
    assert (got.content or "") == want.content
    assert want.reasoning and want.reasoning == text.strip()  # inside the block from the first token


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_streamed_reassembles_to_non_streamed(
    srv: tuple[str, ServerProcess], client: openai.OpenAI, stream_reasoning: bool
) -> None:
    messages = _messages()
    extra = {"stream_reasoning": stream_reasoning}
    whole = client.chat.completions.create(model="m", messages=messages, extra_body=extra, **GREEDY)
    reasoning_pieces, content = [], ""
    finish = None
    for chunk in client.chat.completions.create(
        model="m", messages=messages, stream=True, extra_body=extra, **GREEDY
    ):
        delta = chunk.choices[0].delta
        piece = (delta.model_extra or {}).get("reasoning_content")
        if piece:
            reasoning_pieces.append(piece)
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    message = whole.choices[0].message
    assert ("".join(reasoning_pieces) or None) == (message.model_extra or {})["reasoning_content"]
    assert content == (message.content or "")
    assert finish == whole.choices[0].finish_reason
    if not stream_reasoning:
        assert len(reasoning_pieces) <= 1


def test_responses_api_splits_reasoning(srv: tuple[str, ServerProcess], client: openai.OpenAI) -> None:
    """/v1/responses: the reasoning is a ``reasoning`` item (the chat route's ``reasoning_content``, same
    greedy request), counted in ``reasoning_tokens``; streamed as ``response.reasoning_text.delta`` events
    that add up to it; a continuation by ``previous_response_id`` renders it back (``reasoning_content``),
    so its prompt equals the chat route's for the same conversation and the first turn is a cache hit."""
    text = f"Think about {uuid.uuid4().hex}, then answer."
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], **GREEDY)
    thought = (chat.choices[0].message.model_extra or {})["reasoning_content"]
    kw: dict[str, Any] = {"model": "m", "input": text, "temperature": 0, "max_output_tokens": 12}
    resp = client.responses.create(**kw)
    assert resp.output[0].type == "reasoning"
    assert resp.output[0].content is not None and resp.output[0].content[0].text == thought
    assert resp.usage is not None and 0 < resp.usage.output_tokens_details.reasoning_tokens <= 12
    events = list(client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thought
    final = events[-1].response  # type: ignore[union-attr]
    assert [i.type for i in final.output] == [i.type for i in resp.output]
    follow = client.responses.create(
        model="m", previous_response_id=resp.id, input="Go on.", max_output_tokens=2
    )
    again = client.chat.completions.create(
        model="m", max_tokens=2,
        messages=[{"role": "user", "content": text},
                  {"role": "assistant", "content": chat.choices[0].message.content or "",
                   "reasoning_content": thought},  # type: ignore[typeddict-unknown-key]
                  {"role": "user", "content": "Go on."}],
    )  # fmt: skip
    assert follow.usage is not None and again.usage is not None
    assert follow.usage.input_tokens == again.usage.prompt_tokens
    # cached: at least what the first turn's prompt shares with the second's (a template may render a
    # past assistant turn unlike its generation prompt, as OPENS_THINK does with its "<think>")
    history = [{"role": "user", "content": text}]
    with srv[1].client() as c:
        ids = [
            c.post("/tokenize", json={"messages": m}).json()["tokens"]
            for m in (history, [*history, {"role": "assistant", "content": ""}])
        ]
    shared = next((k for k, (a, b) in enumerate(zip(*ids, strict=False)) if a != b), len(ids[0]))
    assert shared > len(ids[0]) // 2
    assert follow.usage.input_tokens_details.cached_tokens >= shared


def test_constrained_output_is_all_answer(srv: tuple[str, ServerProcess], client: openai.OpenAI) -> None:
    """A grammar constrains the output from its first token: no room for reasoning, nothing split off."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    out = client.chat.completions.create(model="m", messages=_messages(), response_format=fmt, **GREEDY)
    message = out.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") is None
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(message.content or ""), dict)


def test_strip_thinking_cache_keeps_only_the_prompt(
    srv: tuple[str, ServerProcess], client: openai.OpenAI
) -> None:
    """With --strip-thinking-cache (the deepseek-r1 server) a chat request that reasoned leaves only its
    prompt in the RadixCache; without it (the qwen3 server) its output stays cached too. A /generate
    request is never stripped (a program appends the output to its next prompt verbatim)."""
    name, proc = srv
    with proc.client() as c:
        assert c.post("/flush_cache").status_code == 200
        out = client.chat.completions.create(model="m", messages=_messages(), **GREEDY)
        assert out.usage is not None
        prompt, completion = out.usage.prompt_tokens, out.usage.completion_tokens
        cached = wait_idle(c)["kv_cached_tokens"]
        if name == "deepseek-r1":
            assert cached == prompt
        else:
            assert prompt < cached <= prompt + completion
        assert c.post("/flush_cache").status_code == 200
        body = {
            "input_ids": list(range(100, 130)),
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        }
        r = c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert wait_idle(c)["kv_cached_tokens"] > 30


def test_strip_thinking_cache_needs_a_reasoning_parser() -> None:
    with pytest.raises(ValueError, match="strip_thinking_cache: needs --reasoning-parser"):
        ServerArgs(model_path="m", strip_thinking_cache=True)
