"""Run one workload on one system at one parallelism, and turn the records into metrics.

A run starts from an empty cache (`Side.reset`), keeps ``parallel`` programs in flight (a thread per
program; each program's forks add their own threads), and records every request (`Recorder`). Then:

- programs/s = programs / wall time; program latency and per-``gen`` time to first token, p50 / p99;
- prompt tokens (the prompts as sent, tokenized as the server tokenizes them), cached tokens (the
  system's own counter: radixrt's worker, llama.cpp's "prefix-match hit" log lines, ``usage``);
- the optimum (`benchmarks.prefix_workloads.optimum`, the exact one the prefix-cache benchmark uses):
  the union trie of every prompt actually sent in this run, less the prefixes a call's own decoding
  already produced; ``hit_over_optimal`` = cached tokens / optimal hit tokens;
- generated tokens per second; exact match / F1 of the program's answer where a reference exists.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from benchmarks.agents.backends import Side
from benchmarks.agents.data import exact_match, f1_score
from benchmarks.agents.recorder import Recorder, Request
from benchmarks.agents.workload import Workload
from benchmarks.prefix_workloads import Optimum, optimum


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def request_ids(requests: list[Request], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, generated ids) of every request: prompts tokenized as the server does
    (``add_special_tokens=True``); generated ids as returned, else the output text re-tokenized."""
    out = []
    for r in requests:
        prompt = list(tokenizer.encode(r.prompt, add_special_tokens=True))
        gen = (
            r.output_ids
            if r.output_ids is not None
            else list(tokenizer.encode(r.output, add_special_tokens=False))
        )
        out.append((prompt, list(gen)))
    return out


def run_optimum(requests: list[Request], tokenizer: Any) -> Optimum:
    return optimum(request_ids(requests, tokenizer))


def _digest(value: Any) -> str:
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_workload(side: Side, wl: Workload, parallel: int, programs: int, bar: Any = None) -> dict[str, Any]:
    """Run ``programs`` instances of ``wl`` on ``side``, ``parallel`` at a time; the metrics as a dict."""
    base: dict[str, Any] = {
        "workload": wl.name,
        "backend": side.name,
        "parallel": parallel,
        "programs": programs,
    }
    if wl.needs_select and not side.supports_select:
        if bar is not None:
            bar.update(programs)
        return base | {"status": "n/a", "reason": "select needs prompt logprobs, which this backend lacks"}
    side.reset()
    rec = Recorder(side.backend)
    args = wl.take(programs)
    before = side.counters()
    cpu0 = side.cpu_seconds()
    latencies: list[float] = [0.0] * programs
    outputs: list[Any] = [None] * programs
    answers: list[str | None] = [None] * programs
    errors: list[str] = []

    def one(i: int) -> None:
        t0 = time.perf_counter()
        state = wl.program.run(backend=rec, temperature=0, **args[i])
        state.sync()
        err = state.error()
        latencies[i] = time.perf_counter() - t0
        if err is not None:
            errors.append(f"{type(err).__name__}: {err}")
            return
        outputs[i] = wl.outputs(state, args[i])
        answers[i] = wl.answer(state, args[i]) if wl.answer is not None else None

    start = time.perf_counter()
    with ThreadPoolExecutor(parallel, thread_name_prefix=f"{wl.name}-program") as pool:
        for fut in as_completed([pool.submit(one, i) for i in range(programs)]):
            fut.result()
            if bar is not None:
                bar.update(1)
    wall = time.perf_counter() - start
    after = side.counters()
    cpu1 = side.cpu_seconds()
    cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    out = summarize(rec.requests, side, wl, wall, latencies, outputs, answers, before, after, errors)
    return base | out | {"cpu_s": cpu, "cpu_s_per_program": None if cpu is None else cpu / programs}


def summarize(requests: list[Request], side: Side, wl: Workload, wall: float, latencies: list[float],
              outputs: list[Any], answers: list[str | None], before: dict[str, float | None],
              after: dict[str, float | None], errors: list[str]) -> dict[str, Any]:  # fmt: skip
    ids = request_ids(requests, side.tokenizer)
    opt = optimum(ids)
    gens = [r for r in requests if r.kind == "gen"]
    completion = sum(r.completion_tokens if r.completion_tokens is not None else len(g)
                     for r, (_, g) in zip(requests, ids, strict=True) if r.kind == "gen")  # fmt: skip
    delta = {k: (None if after.get(k) is None or before.get(k) is None else float(after[k]) - float(before[k]))  # type: ignore[arg-type]
             for k in after}  # fmt: skip
    cached = delta.get("cached_tokens")
    computed = delta.get("computed_prefill_tokens")
    if cached is None and all(r.cached_tokens is not None for r in requests) and requests:
        cached = float(sum(r.cached_tokens or 0 for r in requests))
    scored = [(a, wl.reference(i)) for i, a in enumerate(answers) if wl.reference(i) is not None]
    ttfts = [r.ttft for r in gens if r.ttft is not None]
    out: dict[str, Any] = {
        "status": "error" if errors else "ok",
        "errors": errors[:3],
        "wall_s": wall,
        "programs_per_s": len(latencies) / wall if wall > 0 else None,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "requests": {k: sum(r.kind == k for r in requests) for k in ("gen", "select", "prefix")},
        "prompt_tokens": opt.prompt_tokens,
        "prompt_tokens_reported": delta.get("prompt_tokens"),
        "cached_tokens": cached,
        "completion_tokens": completion,
        "tok_per_s": completion / wall if wall > 0 else None,
        "hit_rate": cached / opt.prompt_tokens if cached is not None and opt.prompt_tokens else None,
        "optimum": opt.to_dict(),
        "hit_over_optimal": cached / opt.optimal_hit if cached is not None and opt.optimal_hit else None,
        "computed_prefill_tokens": computed,
        "computed_over_optimal": computed / opt.optimal_computed
        if computed is not None and opt.optimal_computed
        else None,
        "retractions": delta.get("retractions"),
        "evicted_tokens": delta.get("evicted_tokens"),
        "exact_match": sum(exact_match(a or "", r or "") for a, r in scored) / len(scored)
        if scored
        else None,
        "f1": sum(f1_score(a or "", r or "") for a, r in scored) / len(scored) if scored else None,
        "scored": len(scored),
        "output_digests": [_digest(o) for o in outputs],
    }
    return out
