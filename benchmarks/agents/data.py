"""The suite's data: HotpotQA ReAct traces, a BM25 "Wikipedia" and passage corpus built from their
observations, and the answer metrics (exact match / F1, SQuAD-style normalization).

The traces file is read in place (``--data``: see ``benchmarks/react_traces.py`` for where it comes from;
without it, synthetic traces of the same shape); nothing is copied into the repository.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rank_bm25 import BM25Okapi

from benchmarks.prefix_workloads import load_react_traces

Step = dict[str, str]


@dataclass(slots=True)
class Trace:
    """One recorded ReAct episode: the question (without "Question: "), its steps, its Finish answer."""

    question: str
    steps: list[Step]

    @property
    def answer(self) -> str | None:
        """The argument of the trace's Finish action (the reference), None if it never finished."""
        for step in reversed(self.steps):
            act = parse_action(step["action"])
            if act is not None and act[0] == "Finish":
                return act[1]
        return None


def load_traces(path: Path) -> list[Trace]:
    """The traces of ``path`` in file order."""
    out = []
    for question, steps in load_react_traces(path):
        q = question.removeprefix("Question:").strip()
        out.append(Trace(q, [{k: str(v) for k, v in s.items()} for s in steps]))
    return out


def split_shots(traces: list[Trace], n: int) -> tuple[list[Trace], list[Trace]]:
    """(few-shot examples, questions): the ``n`` shortest traces that end with Finish (a short header keeps
    every prompt of the suite short), and every other trace in file order."""
    text_len = [sum(len(v) for s in t.steps for v in s.values()) for t in traces]
    finished = [i for i, t in enumerate(traces) if t.answer is not None]
    shots = set(sorted(finished, key=lambda i: (text_len[i], i))[:n])
    return [traces[i] for i in sorted(shots)], [t for i, t in enumerate(traces) if i not in shots]


_ACTION = re.compile(r"(Search|Lookup|Finish)\[(.*?)\]", re.S)


def parse_action(text: str) -> tuple[str, str] | None:
    """The first ``Search[x]`` / ``Lookup[x]`` / ``Finish[x]`` in ``text`` as (kind, argument)."""
    m = _ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else None


# ------------------------------------------------------------------------------------------ retrieval

_WORD = re.compile(r"\w+")


def _tokens(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text.replace("\n", " ")) if s.strip()]


class Wikipedia:
    """Pages from the traces' successful ``Search[title]`` observations; BM25 over title + text.

    ``search`` returns the best page's text (the page becomes current); ``lookup`` the next sentence of
    the current page containing the keyword, as ReAct's Wikipedia environment does.
    """

    def __init__(self, traces: list[Trace]) -> None:
        pages: dict[str, str] = {}
        for trace in traces:
            for step in trace.steps:
                act = parse_action(step["action"])
                obs = step["observation"].strip()
                if act and act[0] == "Search" and obs and not obs.startswith("Could not find"):
                    pages.setdefault(act[1], obs)
        self.titles = list(pages)
        self.texts = [pages[t] for t in self.titles]
        self.bm25 = BM25Okapi(
            [_tokens(t + " " + x) or ["_"] for t, x in zip(self.titles, self.texts, strict=True)]
        )

    def search(self, query: str, max_chars: int = 600) -> tuple[str, str]:
        """(observation, page text) of the best page for ``query``."""
        scores = self.bm25.get_scores(_tokens(query) or ["_"])
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        text = self.texts[best]
        return (text if len(text) <= max_chars else text[:max_chars].rsplit(" ", 1)[0] + " ..."), text

    @staticmethod
    def lookup(page: str | None, keyword: str, seen: int) -> str:
        """The ``seen``-th (0-based) sentence of ``page`` containing ``keyword``."""
        if page is None:
            return "No page is open: use Search first."
        hits = [s for s in _sentences(page) if keyword.lower() in s.lower()]
        if seen >= len(hits):
            return "No more results."
        return f"(Result {seen + 1} / {len(hits)}) {hits[seen]}"


@dataclass(slots=True)
class Corpus:
    """Passages (a few sentences each) cut from every observation of the traces; BM25 top-k."""

    passages: list[str]
    bm25: BM25Okapi = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.bm25 = BM25Okapi([_tokens(p) or ["_"] for p in self.passages])

    @classmethod
    def from_traces(cls, traces: list[Trace], sentences_per_passage: int = 2) -> Corpus:
        seen: dict[str, None] = {}
        for trace in traces:
            for step in trace.steps:
                obs = re.sub(r"^\(Result \d+ / \d+\)\s*", "", step["observation"].strip())
                if not obs or obs.startswith(("Could not find", "No more results", "Episode finished")):
                    continue
                sents = _sentences(obs)
                for i in range(0, len(sents), sentences_per_passage):
                    seen.setdefault(" ".join(sents[i : i + sentences_per_passage])[:400], None)
        return cls(list(seen))

    def top(self, query: str, k: int) -> list[str]:
        scores = self.bm25.get_scores(_tokens(query) or ["_"])
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [self.passages[i] for i in order[:k]]


# ------------------------------------------------------------------------------------------- metrics


def normalize_answer(text: str) -> str:
    """SQuAD's normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def f1_score(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return float(pred == ref)
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)
