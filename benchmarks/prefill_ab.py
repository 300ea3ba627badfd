"""Prefill and extend speed of several radixrt configurations side by side, interleaved (A/B on a noisy box).

    python -m benchmarks.prefill_ab                                  # dense GEMM for prefill vs kernel only
    python -m benchmarks.prefill_ab --config kernel:dense_gemm_min_tokens=0 --config dense: --repeats 9

Each ``--config NAME:FIELD=VALUE,...`` is one Engine (ServerArgs fields; empty: the defaults) on the same
model, all in this process, each with ``--threads`` intra-op threads. Every repeat runs, for each engine in
turn, a prefill of ``--prefill`` tokens (nothing cached) and an extend of ``--extend`` tokens over a cached
``--prefix``-token prefix, one generated token each; the table gives min and median tok/s of the computed
tokens per configuration. Interleaving spreads the machine's load over all configurations alike.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

DEFAULT_CONFIGS = ("kernel:dense_gemm_min_tokens=0", "dense:")


def parse_config(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME:FIELD=VALUE,FIELD=VALUE`` -> (name, Engine kwargs); ints and booleans are converted."""
    name, _, rest = spec.partition(":")
    kw: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        field, _, value = item.partition("=")
        if value.lstrip("-").isdigit():
            kw[field] = int(value)
        elif value in ("true", "false"):
            kw[field] = value == "true"
        else:
            kw[field] = value
    return name, kw


class Case:
    """One engine's timed requests: a prefill of fresh tokens and an extend over a cached prefix."""

    def __init__(self, engine: Any, prefill: int, extend: int, prefix: int, seed: int) -> None:
        self.engine = engine
        self.vocab = engine.worker.scheduler.runner.config.vocab_size
        self.rng = random.Random(seed)
        self.n = (prefill, extend, prefix)
        self.params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab - 100) for _ in range(n)]

    def _timed(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.engine.generate(input_ids=ids, sampling_params=self.params)
        return time.perf_counter() - t0

    def prefill_tok_s(self) -> float:
        self.engine.flush_cache()
        return self.n[0] / self._timed(self._ids(self.n[0]))

    def extend_tok_s(self) -> float:
        self.engine.flush_cache()
        prefix = self._ids(self.n[2])
        self.engine.generate(input_ids=prefix, sampling_params=self.params)
        return self.n[1] / self._timed(prefix + self._ids(self.n[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=None, help="NAME:FIELD=VALUE,... (repeatable)")
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--extend", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=3072)
    ns = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)  # the worker reads it (radixrt/worker/threads.py)
    from radixrt import Engine

    configs = [parse_config(c) for c in (ns.config or DEFAULT_CONFIGS)]
    cases: dict[str, Case] = {}
    try:
        for i, (name, kw) in enumerate(configs):
            t0 = time.perf_counter()
            engine = Engine(model_path=ns.model_path, max_total_tokens=16_384, **kw)
            print(f"{name}: {kw or 'defaults'}, started in {time.perf_counter() - t0:.1f} s", flush=True)
            cases[name] = Case(engine, ns.prefill, ns.extend, ns.prefix, seed=i)
            cases[name].prefill_tok_s(), cases[name].extend_tok_s()  # warm-up
        runs: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "extend": []} for n in cases}
        for rep in range(ns.repeats):
            for name, case in cases.items():
                runs[name]["prefill"].append(case.prefill_tok_s())
                runs[name]["extend"].append(case.extend_tok_s())
            print(f"repeat {rep + 1}/{ns.repeats} done", flush=True)
    finally:
        for case in cases.values():
            case.engine.shutdown()
    p, e, x = ns.prefill, ns.extend, ns.prefix
    print(f"\n{ns.threads} threads, {ns.repeats} interleaved repeats; tok/s of computed tokens, max / median")
    print(f"| config | prefill {p} max | median | extend {e} over {x} max | median |")
    print("|---|---|---|---|---|")
    for name, r in runs.items():
        pm, em = max(r["prefill"]), max(r["extend"])
        pmed, emed = statistics.median(r["prefill"]), statistics.median(r["extend"])
        print(f"| {name} | {pm:.0f} | {pmed:.0f} | {em:.0f} | {emed:.0f} |")


if __name__ == "__main__":
    main()
