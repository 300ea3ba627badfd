"""/tokenize and /detokenize on a live server (vLLM's and SGLang's shapes), with the HF tokenizer as the
oracle, tenant keys reaching them as they reach the generation routes, and 4xx for bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServerProcess
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixrt.server.http.tokenize_api import special_wrap

pytest_plugins = ["server_fixtures"]

ADMIN, TENANT = "sk-admin", "sk-alpha"
TEXTS = [
    "Hello, world!",
    "The radix tree shares prefixes.\nLine two \u00e9\u2603 \U0001f680",
    "<|im_end|> plain",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def srv(server_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with tenants; requests below go with the tenant's key (``ServerProcess.api_key``)."""
    d = tmp_path_factory.mktemp("tokenize")
    (d / "tenants.json").write_text(json.dumps({"tenants": [{"name": "alpha", "api_keys": [TENANT]}]}))
    proc = ServerProcess(
        server_model, d / "server.log", ["--max-total-tokens", "4096", "--tenants", str(d / "tenants.json")],
        ADMIN, cli=False,
    )  # fmt: skip
    try:
        proc.wait_ready()
        proc.api_key = TENANT
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def hf(server_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(server_model)


def post(srv: ServerProcess, route: str, body: dict[str, Any], key: str | None = TENANT) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + route, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("route", ["/tokenize", "/v1/tokenize"])
@pytest.mark.parametrize("special", [None, True, False])
def test_tokenize_prompt_matches_hf(
    srv: ServerProcess, hf: PreTrainedTokenizerBase, route: str, special: bool | None
) -> None:
    for text in TEXTS:
        body: dict[str, Any] = {"model": "any", "prompt": text}
        if special is not None:
            body["add_special_tokens"] = special
        r = post(srv, route, body)
        assert r.status_code == 200, r.text
        want = hf.encode(text, add_special_tokens=special is not False)
        out = r.json()
        assert out == {"tokens": want, "count": len(want), "max_model_len": out["max_model_len"]}
        assert out["max_model_len"] == httpx.get(srv.url + "/v1/models", headers=srv.headers).json()["data"][0]["max_model_len"]  # fmt: skip


def test_tokenize_batch_and_token_strs(srv: ServerProcess, hf: PreTrainedTokenizerBase) -> None:
    r = post(srv, "/tokenize", {"prompt": TEXTS, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    want = [hf.encode(t) for t in TEXTS]
    assert out["tokens"] == want
    assert out["count"] == [len(w) for w in want]
    assert out["token_strs"] == [hf.convert_ids_to_tokens(w) for w in want]


@pytest.mark.parametrize("gen_prompt", [True, False])
def test_tokenize_messages_matches_chat_template(
    srv: ServerProcess, hf: PreTrainedTokenizerBase, gen_prompt: bool
) -> None:
    r = post(srv, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": gen_prompt})
    assert r.status_code == 200, r.text
    want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen_prompt)
    assert r.json()["tokens"] == hf.encode(want, add_special_tokens=False)
    r = post(
        srv,
        "/tokenize",
        {"messages": MESSAGES, "add_generation_prompt": gen_prompt, "add_special_tokens": True},
    )
    assert r.json()["tokens"] == hf.encode(want, add_special_tokens=True)


def test_tokenize_messages_is_the_chat_prompt(srv: ServerProcess) -> None:
    """The count /tokenize gives for messages is the prompt_tokens /v1/chat/completions reports."""
    r = post(srv, "/tokenize", {"messages": MESSAGES})
    chat = post(srv, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]


def test_detokenize_round_trip(srv: ServerProcess, hf: PreTrainedTokenizerBase) -> None:
    for route in ("/detokenize", "/v1/detokenize"):
        for text in TEXTS:
            ids = post(srv, "/tokenize", {"prompt": text}).json()["tokens"]
            r = post(srv, route, {"tokens": ids})
            assert r.status_code == 200, r.text
            assert r.json() == {"prompt": hf.decode(ids), "text": hf.decode(ids)}
            assert r.json()["prompt"] == text
    batch = [hf.encode(t) for t in TEXTS]
    r = post(srv, "/detokenize", {"tokens": batch})
    assert r.json()["prompt"] == TEXTS
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    ids = [im_end, *hf.encode("hi")]
    r = post(srv, "/detokenize", {"tokens": ids, "skip_special_tokens": True})
    assert r.json()["text"] == hf.decode(ids, skip_special_tokens=True) == "hi"


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": []}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [[1], 2]}, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_input_is_400_naming_the_field(
    srv: ServerProcess, route: str, body: dict[str, Any], param: str
) -> None:
    r = post(srv, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or err["message"].startswith(param), err


def test_auth(srv: ServerProcess) -> None:
    """A tenant's key and the admin key reach the routes; no key or an unknown one is a 401."""
    for key in (TENANT, ADMIN):
        assert post(srv, "/tokenize", {"prompt": "a"}, key).status_code == 200
        assert post(srv, "/detokenize", {"tokens": [1]}, key).status_code == 200
    for key in (None, "sk-wrong"):
        assert post(srv, "/tokenize", {"prompt": "a"}, key).status_code == 401
        assert post(srv, "/v1/detokenize", {"tokens": [1]}, key).status_code == 401


def test_special_wrap_finds_bos_and_eos(hf: PreTrainedTokenizerBase) -> None:
    """The wrap for a tokenizer adding nothing is empty; a BOS/EOS post-processor's ids are found."""
    from tokenizers import processors

    assert special_wrap(hf) == ([], [])
    tok = AutoTokenizer.from_pretrained(hf.name_or_path)
    bos, eos = hf.convert_tokens_to_ids("<|im_start|>"), hf.convert_tokens_to_ids("<|im_end|>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", special_tokens=[("<|im_start|>", bos), ("<|im_end|>", eos)]
    )
    assert special_wrap(tok) == ([bos], [eos])
    assert tok.encode("hello there") == [bos, *hf.encode("hello there"), eos]
