"""/v1/embeddings with --is-embedding on a live server, HF transformers' hidden states as the oracle
(last-token and mean pooling, L2-normalized), read with the official ``openai`` client (which asks for
base64) and with httpx (floats); batches of strings and of token ids; 400s for ``dimensions``, bad input,
and a server without an embedding model."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from server_harness import ServerProcess
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

pytest_plugins = ["server_fixtures"]

TEXTS = ["The radix tree shares prefixes.", "The radix tree shares prefixes. And more.", "hello"]


@pytest.fixture(scope="module", params=["last", "mean"])
def srv(
    request: pytest.FixtureRequest, server_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ServerProcess]]:
    """An --is-embedding server; for ``mean`` a copy of the model with a sentence-transformers pooling
    config asking for mean pooling."""
    d = tmp_path_factory.mktemp(f"embed_{request.param}")
    model = server_model
    if request.param == "mean":
        model = Path(shutil.copytree(server_model, d / "model"))
        (model / "1_Pooling").mkdir()
        (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    flags = ["--max-total-tokens", "4096", "--disable-compile", "--is-embedding"]
    proc = ServerProcess(model, d / "server.log", flags, None, cli=False)
    try:
        proc.wait_ready()
        yield str(request.param), proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def hf(server_model: Path) -> tuple[Any, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(server_model, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(server_model)


def oracle(hf: tuple[Any, PreTrainedTokenizerBase], ids: list[int], mode: str) -> torch.Tensor:
    """HF's final (normed) hidden states of ``ids``, pooled and normalized."""
    model, _ = hf
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].double()
    vec = hidden[-1] if mode == "last" else hidden.mean(dim=0)
    return vec / vec.norm()


def check(got: list[float], want: torch.Tensor) -> None:
    g = torch.tensor(got, dtype=torch.float64)
    assert g.shape == want.shape
    assert abs(float(g.norm()) - 1.0) < 1e-5
    assert torch.allclose(g, want, atol=2e-4), float((g - want).abs().max())


def test_openai_client_batch_of_strings(srv: tuple[str, ServerProcess], hf: Any) -> None:
    mode, proc = srv
    with openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        out = client.embeddings.create(model="m", input=TEXTS)  # base64 on the wire
    assert [d.index for d in out.data] == [0, 1, 2]
    tok = hf[1]
    ids = [tok.encode(t) for t in TEXTS]
    for d, i in zip(out.data, ids, strict=True):
        check(d.embedding, oracle(hf, i, mode))
    assert out.usage.prompt_tokens == sum(map(len, ids)) == out.usage.total_tokens


def test_token_ids_and_floats_and_repeats(srv: tuple[str, ServerProcess], hf: Any) -> None:
    """Token id lists, encoding_format float; a repeat (its prefix now cached) gives the same vector."""
    mode, proc = srv
    ids = [[100 + k for k in range(40)], [100 + k for k in range(25)], [7]]
    for _ in range(2):
        r = httpx.post(
            proc.url + "/v1/embeddings", json={"input": ids, "encoding_format": "float"}, timeout=120
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        for d, i in zip(body["data"], ids, strict=True):
            check(d["embedding"], oracle(hf, i, mode))
    r = httpx.post(proc.url + "/v1/embeddings", json={"input": ids[0]}, timeout=120)
    assert len(r.json()["data"]) == 1
    check(r.json()["data"][0]["embedding"], oracle(hf, ids[0], mode))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "a", "dimensions": 8}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [""]}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": [[1, 2], "a", {"x": 1}]}, "input"),
        ({"input": [[10**9]]}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "bogus": 1}, "bogus"),
        ({"input": "word " * 5000}, "input"),
    ],
)
def test_bad_input_is_400(srv: tuple[str, ServerProcess], body: dict[str, Any], param: str) -> None:
    r = httpx.post(srv[1].url + "/v1/embeddings", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_without_an_embedding_model(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "a"}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "model_not_embedding" and "--is-embedding" in err["message"]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="--is-embedding"):
            client.embeddings.create(model="m", input="a")
