"""DSPy-style multi-hop RAG over a BM25 corpus cut from the traces' observations.

One growing prompt per question, the way an SGLang program writes DSPy's multi-hop pipeline: a shared
instruction header with a few solved demonstrations, the question, ``rag_k`` passages retrieved for it,
then per further hop a generated search query (``gen``, one line) and ``rag_k`` passages for
question + query; finally the answer (``gen``, one line). ``rag_verify`` adds a ``select``-based check:
"Is the answer supported by the context?" yes / no (needs choice logprobs from the backend).
"""

from __future__ import annotations

import frontend_lang as sgl
from benchmarks.agents.data import Corpus, Trace, split_shots
from benchmarks.agents.workload import Args, Scale, Workload
from frontend_lang import ProgramState

INSTRUCTION = (
    "Answer questions with short factoid answers, using the numbered passages of the context.\n\n"
    "Follow this format.\nContext: passages that may contain relevant facts\nQuestion: the question\n"
    "Search query: a short query for the facts still missing\nAnswer: often between 1 and 5 words\n\n"
)


def header(shots: list[Trace], corpus: Corpus) -> str:
    text = INSTRUCTION
    for trace in shots:
        if trace.answer is None:
            continue
        passage = corpus.top(trace.question, 1)[0]
        text += f"---\nContext:\n[1] {passage}\nQuestion: {trace.question}\nAnswer: {trace.answer}\n\n"
    return text + "---\n"


def workloads(traces: list[Trace], scale: Scale, corpus: Corpus | None = None) -> list[Workload]:
    corpus = corpus if corpus is not None else Corpus.from_traces(traces)
    shots, questions = split_shots(traces, scale.react_shots)
    head = header(shots, corpus)
    k, hops, max_tokens = scale.rag_k, scale.rag_hops, scale.rag_max_tokens

    def make(verify: bool) -> sgl.Program:
        def rag(s: ProgramState, question: str) -> None:
            s += head + "Context:\n"
            seen: list[str] = []
            query = question
            for hop in range(hops):
                fresh = [p for p in corpus.top(query, k + len(seen)) if p not in seen][:k]
                s += "".join(f"[{len(seen) + j + 1}] {p}\n" for j, p in enumerate(fresh))
                seen += fresh
                if hop == 0:
                    s += f"Question: {question}\n"
                if hop < hops - 1:
                    s += (
                        "Search query:" + sgl.gen(f"query_{hop + 1}", max_tokens=max_tokens, stop="\n") + "\n"
                    )
                    s += "Context:\n"
                    query = question + " " + s[f"query_{hop + 1}"]
            s += "Answer:" + sgl.gen("answer", max_tokens=max_tokens, stop="\n") + "\n"
            if verify:
                s += "Is the answer supported by the context? " + sgl.select(
                    "supported", choices=["yes", "no"]
                )

        rag.__name__ = "rag_verify" if verify else "rag"
        return sgl.function(rag)

    def outputs(state: ProgramState, args: Args) -> str:
        return state.text()

    def answer(state: ProgramState, args: Args) -> str:
        return str(state["answer"]).strip()

    out = []
    for verify in (False, True):
        out.append(
            Workload(
                "rag_verify" if verify else "rag",
                make(verify),
                [{"question": t.question} for t in questions],
                needs_select=verify,
                outputs=outputs,
                answer=answer,
                references=[t.answer for t in questions],
                description=f"{hops}-hop BM25 RAG, k={k} over {len(corpus.passages)} passages"
                + (", select verification" if verify else ""),
            )
        )
    return out
