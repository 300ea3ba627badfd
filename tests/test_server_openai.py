"""The OpenAI-compatible API of a real server process, through the official ``openai`` client."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import openai
import pytest
from server_harness import ServerProcess, wait_idle

pytest_plugins = ["server_fixtures"]


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def unique(words: int = 30) -> str:
    """A prompt no other test has sent (so nothing of it is cached yet)."""
    tag = uuid.uuid4().hex
    return " ".join(
        f"{tag[i % 32]}{w}" for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * (words // 4))
    )


def msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


def test_models(client: openai.OpenAI, server: ServerProcess) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.info["model_info"]["served_model_name"]]
    assert client.models.retrieve(models[0].id).id == models[0].id


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    """Oracle: greedy decoding is deterministic, so the streamed deltas add up to the full answer."""
    text = unique()
    full = client.chat.completions.create(model="m", messages=msgs(text), max_tokens=20, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.usage is not None and full.usage.completion_tokens == 20
    assert full.usage.total_tokens == full.usage.prompt_tokens + 20
    assert (
        full.usage.prompt_tokens_details is not None
        and full.usage.prompt_tokens_details.cached_tokens is not None
    )
    stream = client.chat.completions.create(model="m", messages=msgs(text), max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None and usage.completion_tokens == 20
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1  # the same prompt again


def test_repeated_prefix_is_reported_cached(client: openai.OpenAI) -> None:
    prefix = unique(40)
    first = client.completions.create(model="m", prompt=prefix + " one", max_tokens=2)
    second = client.completions.create(model="m", prompt=prefix + " two", max_tokens=2)
    assert first.usage is not None and second.usage is not None
    d1, d2 = first.usage.prompt_tokens_details, second.usage.prompt_tokens_details
    assert d1 is not None and d2 is not None and d1.cached_tokens is not None and d2.cached_tokens is not None
    assert d1.cached_tokens <= 1  # at most the BOS-like first token was seen before
    assert d2.cached_tokens >= first.usage.prompt_tokens - 3  # all but the differing tail


def test_stop_string_spanning_tokens(client: openai.OpenAI) -> None:
    """Stop strings cut the text (also when streamed: nothing past the stop is ever sent)."""
    text = unique()
    ref = client.completions.create(model="m", prompt=text, max_tokens=24, temperature=0).choices[0].text
    stop = ref[9:13]
    want = ref[: ref.find(stop)]
    out = client.completions.create(model="m", prompt=text, max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model="m", prompt=text, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want


def test_n_and_seed(client: openai.OpenAI) -> None:
    kw = dict(model="m", messages=msgs("pick a word"), max_tokens=8, n=3, temperature=1.0, seed=123)
    a = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    b = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded
    assert len({c.message.content for c in a.choices}) > 1  # the choices differ from each other
    assert a.usage is not None and a.usage.completion_tokens == 24
    stream = client.chat.completions.create(**kw, stream=True)  # type: ignore[call-overload]
    texts = ["", "", ""]
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in a.choices]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="m", messages=msgs("hello"), max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3)  # fmt: skip
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob, abs=1e-5)  # greedy = argmax
        assert bytes(tok.bytes or []) == tok.token.encode()


def test_completions_batch_echo_logprobs(client: openai.OpenAI) -> None:
    prompts = ["the first prompt", "another prompt here"]
    out = client.completions.create(model="m", prompt=prompts, max_tokens=5, temperature=0, n=2, echo=True,
                                    logprobs=2)  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        prompt = prompts[c.index // 2]
        assert c.text.startswith(prompt)
        lp = c.logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert "".join(lp.tokens) == c.text and lp.token_logprobs[0] is None
        assert lp.text_offset is not None and lp.text_offset[1] == len(lp.tokens[0])
    assert out.choices[0].text == out.choices[1].text  # greedy: both samples agree
    assert out.usage is not None and out.usage.completion_tokens == 20


def test_extra_sampling_fields(client: openai.OpenAI, server: ServerProcess) -> None:
    extra = {"top_k": 5, "min_p": 0.05, "ignore_eos": True, "regex": "[a-z ]+", "repetition_penalty": 1.1}
    out = client.chat.completions.create(model="m", messages=msgs("hi"), max_tokens=7, extra_body=extra)
    assert out.usage is not None and out.usage.completion_tokens == 7
    prompt = unique()
    a = client.completions.create(
        model="m", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-a"}
    )
    b = client.completions.create(
        model="m", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-b"}
    )
    c = client.completions.create(
        model="m", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-a"}
    )
    cached = [x.usage.prompt_tokens_details.cached_tokens for x in (a, b, c)]  # type: ignore[union-attr]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] == a.usage.prompt_tokens - 1  # type: ignore[union-attr]
    with server.client() as hc:
        wait_idle(hc)


def test_errors_through_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[], max_tokens=3)
    assert "messages" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", max_tokens=3, temperature=5.0, top_p=0.0)
