"""Token-level workloads for the prefix-cache benchmark, and the exact optimum (a union trie).

A workload is a set of independent *chains*; each chain is a sequence of dependent calls whose prompt
grows from the previous one: ``prompt_k = prompt_{k-1} + (answer_{k-1} if carry_answer) + append_k``.

- ``shared``: SGLang's ``generated-shared-prefix`` dataset: groups of prompts sharing a random system
  prompt, each followed by its own random question; single calls, submitted in shuffled order.
- ``chat``: multi-turn chat: every turn's prompt is the previous prompt + the model's answer + a new
  user message (all conversations share one system prompt).
- ``react``: ReAct traces (SGLang's ReAct benchmark data when ``--data`` exists, synthetic otherwise):
  a few-shot header, then per trace one call per step on the growing scratchpad (teacher forced: the
  recorded thought/action/observation is appended, the model's own answer is not).

Segments are tokenized separately and concatenated, so every prompt is a token-level extension of the
previous one (what a frontend that appends to a running prompt sends).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

FIRST_ID = 3  # random token ids start above the special tokens of the benchmark tokenizer


@dataclass(slots=True)
class Call:
    """One request of a chain: what it appends to the previous prompt, and how much it generates."""

    append: list[int]
    max_new_tokens: int
    carry_answer: bool = False


@dataclass(slots=True)
class Workload:
    """Independent chains of dependent calls, plus the parameters that made them."""

    name: str
    chains: list[list[Call]]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_calls(self) -> int:
        return sum(len(c) for c in self.chains)

    def max_seq_len(self) -> int:
        """Longest prompt + output of any call (answers counted at their full length)."""
        best = 0
        for chain in self.chains:
            n = 0
            prev_out = 0
            for call in chain:
                n += (prev_out if call.carry_answer else 0) + len(call.append)
                best = max(best, n + call.max_new_tokens)
                prev_out = call.max_new_tokens
        return best


def _rand(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def shared_prefix(
    groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    vocab: int,
    seed: int = 0,
) -> Workload:
    """``generated-shared-prefix``: ``groups`` system prompts x ``prompts_per_group`` questions, shuffled."""
    rng = random.Random(seed)
    chains = []
    for _ in range(groups):
        system = _rand(rng, system_len, vocab)
        for _ in range(prompts_per_group):
            chains.append([Call(system + _rand(rng, question_len, vocab), output_len)])
    rng.shuffle(chains)
    return Workload(
        "shared",
        chains,
        dict(
            groups=groups,
            prompts_per_group=prompts_per_group,
            system_len=system_len,
            question_len=question_len,
            output_len=output_len,
        ),
    )


def multi_turn_chat(
    convs: int, turns: int, system_len: int, user_len: int, output_len: int, vocab: int, seed: int = 0
) -> Workload:
    """``convs`` conversations of ``turns`` turns; turn k+1 = turn k's prompt + its answer + a user message."""
    rng = random.Random(seed + 1)
    system = _rand(rng, system_len, vocab)
    chains = []
    for _ in range(convs):
        chain = [Call(system + _rand(rng, user_len, vocab), output_len)]
        chain += [Call(_rand(rng, user_len, vocab), output_len, carry_answer=True) for _ in range(turns - 1)]
        chains.append(chain)
    return Workload(
        "chat",
        chains,
        dict(convs=convs, turns=turns, system_len=system_len, user_len=user_len, output_len=output_len),
    )


REACT_INSTRUCTION = (
    "Answer the question by interleaving Thought, Action and Observation steps. A Thought reasons about "
    "the current situation. An Action is one of: Search[entity], which returns the first paragraph of the "
    "entity's Wikipedia page if it exists (or similar entities to try otherwise); Lookup[keyword], which "
    "returns the next sentence containing the keyword in the current passage; Finish[answer], which "
    "returns the answer and ends the task.\nExamples:\n"
)


def load_react_traces(path: Path) -> list[tuple[str, list[dict[str, str]]]]:
    """Read ``{"Question: ...": [{"thought", "action", "observation"}, ...]}`` lines."""
    traces = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                for question, steps in obj.items():
                    traces.append((str(question), list(steps)))
    return traces


def _step_text(k: int, step: dict[str, str]) -> str:
    return (
        f" {step['thought']}\nAction {k}: {step['action']}\nObservation {k}: {step['observation'].strip()}\n"
    )


def react_from_data(
    path: Path, tokenizer: PreTrainedTokenizerBase, traces: int, fewshot: int, output_len: int
) -> Workload:
    """The first ``fewshot`` traces form the shared header; the next ``traces`` become chains."""
    data = load_react_traces(path)
    if len(data) < fewshot + 1:
        raise ValueError(f"{path}: {len(data)} traces, need more than --react-fewshot={fewshot}")

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    header = REACT_INSTRUCTION
    for question, steps in data[:fewshot]:
        header += question + "\n" + "".join(f"Thought {k}:{_step_text(k, s)}" for k, s in enumerate(steps, 1))
        header += "\n"
    header_ids = enc(header)
    chains = []
    for question, steps in data[fewshot : fewshot + traces]:
        chain = [Call(header_ids + enc(question + "\n") + enc("Thought 1:"), output_len)]
        for k, step in enumerate(steps[:-1], 1):
            chain.append(Call(enc(_step_text(k, step)) + enc(f"Thought {k + 1}:"), output_len))
        chains.append(chain)
    return Workload(
        "react",
        chains,
        dict(
            source=path.name,  # the file's name: no machine path in the results
            traces=len(chains),
            fewshot=fewshot,
            header_tokens=len(header_ids),
            output_len=output_len,
        ),
    )


def react_synthetic(traces: int, header_len: int, output_len: int, vocab: int, seed: int = 0) -> Workload:
    """ReAct-shaped chains from random tokens: shared header, question, 2-5 steps of thought/action/observation."""
    rng = random.Random(seed + 2)
    header = _rand(rng, header_len, vocab)
    chains = []
    for _ in range(traces):
        n_steps = rng.randint(2, 5)
        chain = [Call(header + _rand(rng, rng.randint(16, 48), vocab), output_len)]
        for _ in range(n_steps - 1):
            step = _rand(rng, rng.randint(16, 40) + rng.randint(4, 12) + rng.randint(60, 300), vocab)
            chain.append(Call(step, output_len))
        chains.append(chain)
    return Workload(
        "react",
        chains,
        dict(source="synthetic", traces=traces, header_tokens=header_len, output_len=output_len),
    )


# ----------------------------------------------------------------------------------------- the optimum


class _Node:
    __slots__ = ("children", "decoded")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.decoded = False


@dataclass(slots=True)
class Optimum:
    """Exact prefill optimum of a set of (prompt, output) pairs.

    ``union_prompt_tokens``: size of the union trie of all prompts (each distinct prefix once).
    ``decode_supplied``: union-trie tokens whose KV some earlier call already produced by *decoding*
    (its output, when a later prompt carries it), which therefore never need a prefill.
    ``optimal_computed = union_prompt_tokens - decode_supplied``; ``optimal_hit = prompt_tokens -
    optimal_computed``.
    """

    prompt_tokens: int
    union_prompt_tokens: int
    decode_supplied: int

    @property
    def optimal_computed(self) -> int:
        return self.union_prompt_tokens - self.decode_supplied

    @property
    def optimal_hit(self) -> int:
        return self.prompt_tokens - self.optimal_computed

    @property
    def optimal_hit_rate(self) -> float:
        return self.optimal_hit / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "union_prompt_tokens": self.union_prompt_tokens,
            "decode_supplied": self.decode_supplied,
            "optimal_computed": self.optimal_computed,
            "optimal_hit": self.optimal_hit,
            "optimal_hit_rate": self.optimal_hit_rate,
        }


def optimum(records: list[tuple[list[int], list[int]]]) -> Optimum:
    """Union trie of all prompts; then mark prompt-trie nodes that lie on some call's decoded tokens.

    The decoded tokens of a call are ``output[:-1]`` after its prompt (the last output token is never
    fed through the model). Only nodes already in the prompt trie are marked, so this counts exactly
    the prompt prefixes whose KV exists without any prefill.
    """
    root = _Node()
    union = 0
    total = 0
    for prompt, _ in records:
        total += len(prompt)
        node = root
        for tok in prompt:
            nxt = node.children.get(tok)
            if nxt is None:
                nxt = node.children[tok] = _Node()
                union += 1
            node = nxt
    supplied = 0
    for prompt, output in records:
        node = root
        for tok in prompt:
            node = node.children[tok]
        for tok in output[:-1]:
            nxt = node.children.get(tok)
            if nxt is None:
                break
            if not nxt.decoded:
                nxt.decoded = True
                supplied += 1
            node = nxt
    return Optimum(total, union, supplied)


def union_size(seqs: list[list[int]]) -> int:
    """Number of distinct non-empty prefixes of ``seqs`` (the union trie's size)."""
    root: dict[int, Any] = {}
    n = 0
    for seq in seqs:
        node = root
        for tok in seq:
            nxt = node.get(tok)
            if nxt is None:
                nxt = node[tok] = {}
                n += 1
            node = nxt
    return n


def dry_run_sequences(workload: Workload) -> list[list[int]]:
    """Every call's prompt + output with each answer replaced by unique placeholder ids (negative).

    Its union size is the working set: what the tree holds when nothing is evicted.
    """
    seqs = []
    fresh = -1
    for chain in workload.chains:
        prompt: list[int] = []
        answer: list[int] = []
        for call in chain:
            prompt = prompt + (answer if call.carry_answer else []) + call.append
            answer = list(range(fresh, fresh - call.max_new_tokens, -1))
            fresh -= call.max_new_tokens
            seqs.append(prompt + answer)
    return seqs
