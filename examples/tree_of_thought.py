"""Tree of thought with ``fork``: propose several next steps, judge each with ``select``, keep the best.

``python examples/tree_of_thought.py`` — each level forks the conversation into WIDTH branches. The fork
first commits the shared text to the server (one prefill-only request), so the branches, which run
concurrently, all reuse it; each branch's "is it promising?" select is one batched scoring request.
"""

from __future__ import annotations

import time
from typing import Any

from common import make_backend, parse_args, print_cache_stats

import frontend_lang as sgl

QUESTION = (
    "A farmer has 17 sheep and all but 9 run away. He then buys twice as many as he has left. "
    "How many sheep does he have now?"
)


@sgl.function
def tree_of_thought(s: Any, question: str, width: int = 3, depth: int = 2) -> list[dict[str, Any]]:
    s += sgl.system("Solve problems step by step. Propose a next step, judge it, keep the best one.")
    s += sgl.user(question)
    s += sgl.assistant_begin()
    levels = []
    for level in range(1, depth + 1):
        branches = s.fork(width)
        for i, b in enumerate(branches):
            b += f"\nStep {level} (option {i + 1}):" + sgl.gen(
                "step", max_tokens=24, stop="\n", temperature=0.9
            )
            b += "\nIs this step correct and useful? " + sgl.select("verdict", choices=["yes", "no"])
        branches.join()  # s["step"], s["verdict"] and their meta info become lists over the branches
        margins = [m["scores"][0] - m["scores"][1] for m in s.get_meta_info("verdict")]
        best = max(range(width), key=lambda i: margins[i])
        levels.append({"steps": s["step"], "margins": margins, "best": best})
        s += f"\nStep {level}:" + s["step"][best]
    s += "\nFinal answer:" + sgl.gen("answer", max_tokens=16, stop="\n")
    s += sgl.assistant_end()
    return levels


def main() -> None:
    ns = parse_args(__doc__, lambda p: p.add_argument("--width", type=int, default=3))
    started = time.perf_counter()
    backend = make_backend(ns)
    st = tree_of_thought.run(question=QUESTION, width=ns.width, temperature=0.8)
    if st.error() is not None:
        raise SystemExit(f"error: {st.error()!r}")
    print(f"Question: {QUESTION}")
    for depth, level in enumerate(st.ret_value, start=1):
        print(f"\nlevel {depth}:")
        for i, (step, margin) in enumerate(zip(level["steps"], level["margins"], strict=True)):
            mark = "*" if i == level["best"] else " "
            print(f" {mark} option {i + 1} (yes-no logprob margin {margin:+.2f}): {step[:70]!r}")
    print(f"\nfinal answer: {st['answer'][:80]!r}")
    print_cache_stats(backend, started)
    backend.shutdown()


if __name__ == "__main__":
    main()
