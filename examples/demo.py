"""The demo: the ReAct agent, then structured answers, on one in-process Engine.

``python examples/demo.py`` (what ``bash scripts/demo.sh`` runs) loads the embedded SmolLM2-135M-Instruct
once (the decode step is compiled once) and runs ``react_agent.run`` then ``classify.run`` on it; each
example also runs on its own (``python examples/react_agent.py``). Greedy decoding throughout: the same
text on every run. Results go to stdout; progress bars and timings to stderr.
"""

from __future__ import annotations

import time

import classify
import react_agent
from common import cache_counters, make_backend, parse_args, print_cache_stats, progress

PROGRAMS = [
    ("ReAct agent: few-shot Thought / Action / Observation, a toy search tool", react_agent.run),
    ("structured answers: select a label, a rating forced to [1-5]", classify.run),
]


def main() -> None:
    ns = parse_args(__doc__)
    started = time.perf_counter()
    backend = make_backend(ns)
    for i, (title, run) in enumerate(PROGRAMS, 1):
        print(f"\n=== {i}/{len(PROGRAMS)} {title}", flush=True)
        progress(f"{run.__module__}: the shared few-shot prompt is prefilled once, then every program runs")
        before, t0 = cache_counters(backend), time.perf_counter()
        run(backend)
        print_cache_stats(backend, t0, before)
    backend.shutdown()
    progress(f"demo finished in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
