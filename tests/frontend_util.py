"""Helpers of the frontend_lang tests: token counting, a model-free FakeBackend, shared text."""

from __future__ import annotations

import threading
import time
from typing import Any

import frontend_lang as sgl
from frontend_lang.backends.base import BaseBackend, PromptContext
from frontend_lang.chat_template import ChatTemplate, get_chat_template
from frontend_lang.choices import ChoiceScores, ChoicesDecision, ChoicesMethod
from frontend_lang.ir import GenParams

# ~70 tokens of constant text: long enough that the scheduler's in-batch dedup applies to it.
FEW_SHOT = (
    "You are a careful assistant that answers in one short line.\n"
    "Q: What is the capital of France?\nA: Paris.\n"
    "Q: How many legs does a spider have?\nA: Eight.\n"
    "Q: Which planet is closest to the sun?\nA: Mercury.\n"
)


def counters(backend: BaseBackend) -> dict[str, float]:
    info = backend.get_server_info()
    return {k: info[k] for k in ("num_requests", "cached_tokens", "computed_prefill_tokens", "prompt_tokens")}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def union_trie_size(prompts: list[list[int]]) -> int:
    """Tokens a perfect prefix cache computes for these prompts: the node count of their trie."""
    nodes: set[tuple[int, ...]] = set()
    for p in prompts:
        nodes.update(tuple(p[: i + 1]) for i in range(len(p)))
    return len(nodes)


class FakeBackend(BaseBackend):
    """A backend without a model: gen answers ``reply`` after ``delay`` seconds and records how many
    calls overlapped; select prefers the shortest choice. For interpreter semantics and templates."""

    def __init__(self, template: ChatTemplate | None = None, delay: float = 0.0, reply: str = "ok") -> None:
        self.chat_template = template or get_chat_template("chatml")
        self.delay, self.reply = delay, reply
        self.lock = threading.Lock()
        self.active = self.max_active = 0
        self.prompts: list[str] = []
        self.cached: list[str] = []

    def cache_prefix(self, text: str) -> None:
        self.cached.append(text)

    def generate(self, ctx: PromptContext, params: GenParams) -> tuple[Any, dict[str, Any]]:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.prompts.append(ctx.text)
        time.sleep(self.delay)
        with self.lock:
            self.active -= 1
        return self.reply, {"params": params}

    def select(
        self, ctx: PromptContext, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        return method.decide(ChoiceScores(choices, [[-float(len(c))] for c in choices]), temperature)


# -- programs and checks shared by the Engine and server tests ------------------------------------

QUESTION = FEW_SHOT + "Q: What color is the sky?\nA:"
CHOICES = [" Blue.", " Green and yellow.", " Red", " Paris is far away."]


@sgl.function
def cont(s: Any, stops: list[str] | None) -> None:
    s += QUESTION + sgl.gen("x", max_tokens=24, stop=stops, temperature=0, ignore_eos=True)


@sgl.function
def pick(s: Any, method: str) -> None:
    s += QUESTION + sgl.select("c", choices=CHOICES, choices_method=method)


@sgl.function
def tree(s: Any, q: str) -> None:
    s += FEW_SHOT + "Q: " + q + "\nA:"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f" Option {i}:" + sgl.gen("o", max_tokens=4, temperature=0, ignore_eos=True)
    forks.join()


@sgl.function
def ask(s: Any, q: str) -> None:
    s += FEW_SHOT + "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=4, temperature=0, ignore_eos=True)


def check_stop_strings(backend: BaseBackend) -> None:
    full = cont.run(stops=None, backend=backend)["x"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    s = cont.run(stops=["@@never@@", stop], backend=backend)
    assert s.error() is None
    assert s["x"] == full[: full.find(stop)]
    assert s.get_meta_info("x")["finish_reason"] == {"type": "stop", "matched": stop}
    assert s.text() == QUESTION + s["x"]


def check_select_cache(backend: Any) -> dict[str, float]:
    """select commits the text before the choices (a prefill-only request), then scores the choices
    in one batched request; cold, the prefix is computed once, warm, only the commit's last token and
    the choice tokens with the boundary token are."""
    calls: list[dict[str, Any]] = []
    real = backend._call
    backend._call = lambda payload: calls.append(payload) or real(payload)
    try:
        full = [backend.tokenizer.encode(QUESTION + c) for c in CHOICES]
        boundary = len(backend.tokenizer.encode(QUESTION))
        assert backend.flush_cache()
        c0 = counters(backend)
        s = pick.run(method="token_length_normalized", backend=backend)
        s.sync()  # run() returns before the program's requests finish
        cold = delta(c0, counters(backend))
        c1 = counters(backend)
        pick.run(method="token_length_normalized", backend=backend).sync()
        warm = delta(c1, counters(backend))
    finally:
        del backend._call
    k = len(CHOICES)
    assert s.error() is None and len(calls) == 4 and cold["num_requests"] == 1 + k
    assert calls[0]["input_ids"] == full[0][:boundary] and calls[0]["sampling_params"]["max_new_tokens"] == 0
    assert calls[1]["logprob_start_len"] == [boundary] * k
    assert s.get_meta_info("c")["prefix_commit"] == {"prompt_tokens": boundary, "cached_tokens": 0}
    choice_tokens = sum(len(f) - boundary + 1 for f in full)  # each choice recomputes the boundary token
    assert cold["computed_prefill_tokens"] == boundary + choice_tokens
    assert warm["computed_prefill_tokens"] == 1 + choice_tokens
    return {"prompt": sum(map(len, full)), "cold": cold["computed_prefill_tokens"],
            "warm": warm["computed_prefill_tokens"]}  # fmt: skip


def check_fork_cache(backend: Any) -> dict[str, float]:
    """fork commits the shared prefix once (prefill-only); every branch then hits it."""
    tok = backend.tokenizer
    text = FEW_SHOT + "Q: Why is the sea salty?\nA:"
    prefix = tok.encode(text)
    branches = [tok.encode(text + f" Option {i}:") for i in range(3)]
    assert backend.flush_cache()
    c0 = counters(backend)
    s = tree.run(q="Why is the sea salty?", backend=backend)
    s.sync()
    d = delta(c0, counters(backend))
    assert s.error() is None and len(s["o"]) == 3
    assert d["num_requests"] == 1 + 3  # the prefill-only commit, then the branches
    for meta, ids in zip(s.get_meta_info("o"), branches, strict=True):
        assert meta["cached_tokens"] >= lcp(prefix, ids)  # every branch hit the committed prefix
    upper = len(prefix) + sum(len(b) - lcp(prefix, b) for b in branches)
    assert union_trie_size([prefix, *branches]) <= d["computed_prefill_tokens"] <= upper
    return {
        "prompt": sum(map(len, branches)),
        "computed": d["computed_prefill_tokens"],
        "cached": d["cached_tokens"],
    }


def check_run_batch_cache(backend: Any) -> dict[str, float]:
    """run_batch traces the constant prefix and precaches it once; results come back in order."""
    tok = backend.tokenizer
    qs = ["Why?", "Who wrote Hamlet?", "Where is Rome?", "When did it rain?", "How far is the moon?"]
    assert ask.trace(backend=backend).prefix == FEW_SHOT + "Q: "
    prefix = tok.encode(FEW_SHOT + "Q: ")
    prompts = [tok.encode(FEW_SHOT + "Q: " + q + "\nA:") for q in qs]
    assert backend.flush_cache()
    c0 = counters(backend)
    states = ask.run_batch([{"q": q} for q in qs], progress_bar=False, backend=backend)
    d = delta(c0, counters(backend))
    assert all(s.error() is None for s in states)
    assert d["num_requests"] == len(qs) + 1  # one precache request for the whole batch
    for s, ids in zip(states, prompts, strict=True):
        assert s.get_meta_info("a")["cached_tokens"] >= lcp(prefix, ids)
    upper = len(prefix) + sum(len(p) - lcp(prefix, p) for p in prompts)
    assert union_trie_size([prefix, *prompts]) <= d["computed_prefill_tokens"] <= upper
    # results in input order: each equals the program run alone (greedy)
    assert [s["a"] for s in states] == [ask.run(q=q, backend=backend)["a"] for q in qs]
    return {
        "prompt": sum(map(len, prompts)),
        "computed": d["computed_prefill_tokens"],
        "cached": d["cached_tokens"],
    }
