"""Multi-hop RAG: BM25 retrieval (rank_bm25) over a small corpus, then answer with the passages.

``python examples/rag_pipeline.py`` — hop 1 retrieves with the question; the model writes a follow-up
query; hop 2 retrieves with that query expanded by the hop-1 passages (so the bridge entity, e.g.
"Paris", reaches the retriever); the model answers from all passages. The shared system prompt is cached
once for the batch and the second turn reuses the whole first turn.
"""

from __future__ import annotations

import re
import time
from typing import Any

from common import make_backend, parse_args, print_cache_stats
from rank_bm25 import BM25Okapi

import frontend_lang as sgl

CORPUS = [
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris.",
    "Paris is the capital of France; the river Seine flows through the city.",
    "The Colosseum is an ancient amphitheatre in the centre of Rome.",
    "Rome is the capital of Italy; the river Tiber flows through the city.",
    "Big Ben is the nickname of the great bell of the clock at the Palace of Westminster in London.",
    "London is the capital of the United Kingdom; the river Thames flows through it.",
    "The Brandenburg Gate is an 18th-century monument in Berlin.",
    "Berlin is the capital of Germany; the rivers Spree and Havel flow through it.",
    "Mount Kilimanjaro is a dormant volcano in Tanzania and the highest mountain in Africa.",
    "Tanzania is a country in East Africa whose capital is Dodoma.",
    "The Danube flows through Vienna, Bratislava, Budapest and Belgrade.",
    "A radix tree is a space-optimized trie in which each node with one child is merged with its parent.",
]
QUESTIONS = [
    "Which river flows through the city where the Eiffel Tower stands?",
    "Which river flows through the city that has the Colosseum?",
    "What is the capital of the country with the highest mountain in Africa?",
]
SYSTEM = (
    "You answer questions using only the numbered passages you are given. First write one follow-up "
    "search query for the missing fact, then, once you have the new passages, answer in a few words."
)


def tokenize(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


BM25 = BM25Okapi([tokenize(d) for d in CORPUS])


def retrieve(query: str, k: int = 2, exclude: tuple[int, ...] = ()) -> list[int]:
    scores = BM25.get_scores(tokenize(query))
    ranked = sorted((i for i in range(len(CORPUS)) if i not in exclude), key=lambda i: -scores[i])
    return ranked[:k]


def passages(ids: list[int]) -> str:
    return "".join(f"[{i}] {CORPUS[i]}\n" for i in ids)


@sgl.function
def rag(s: Any, question: str) -> dict[str, Any]:
    s += sgl.system(SYSTEM)
    hop1 = retrieve(question)
    s += sgl.user(f"Question: {question}\nPassages:\n{passages(hop1)}Follow-up query?")
    s += sgl.assistant(sgl.gen("query", max_tokens=16, stop="\n"))
    expanded = " ".join([s["query"], *(CORPUS[i] for i in hop1)])
    hop2 = retrieve(expanded, exclude=tuple(hop1))
    s += sgl.user(f"New passages:\n{passages(hop2)}Answer the question.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=24, stop="\n"))
    return {"hop1": hop1, "hop2": hop2}


def main() -> None:
    ns = parse_args(__doc__)
    started = time.perf_counter()
    backend = make_backend(ns)
    states = rag.run_batch([{"question": q} for q in QUESTIONS], temperature=0.7, progress_bar=True)
    for q, st in zip(QUESTIONS, states, strict=True):
        if st.error() is not None:
            print(f"\n{q}\n  error: {st.error()!r}")
            continue
        hops = st.ret_value
        print(f"\n{q}")
        print(f"  hop 1 passages {hops['hop1']}: " + " | ".join(CORPUS[i][:50] for i in hops["hop1"]))
        print(f"  follow-up query: {st['query'][:80]!r}")
        print(f"  hop 2 passages {hops['hop2']}: " + " | ".join(CORPUS[i][:50] for i in hops["hop2"]))
        print(f"  answer: {st['answer'][:80]!r}")
    print_cache_stats(backend, started)
    backend.shutdown()


if __name__ == "__main__":
    main()
