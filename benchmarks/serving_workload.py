"""Workloads and statistics of the serving benchmark (``benchmarks/serving.py``): SGLang bench_serving's
datasets as token ids, per-request outcomes, and their summary (throughputs, latency mean / median / p99).
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

FIRST_ID, VOCAB = 3, 8000  # random ids avoid the special tokens of the benchmark tokenizer


@dataclass(slots=True)
class Request:
    input_ids: list[int]
    output_len: int


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


# -- datasets -----------------------------------------------------------------------------------
def generated_shared_prefix(args: argparse.Namespace, rng: random.Random) -> list[Request]:
    out = []
    for _ in range(args.gsp_num_groups):
        system = [rng.randrange(FIRST_ID, VOCAB) for _ in range(args.gsp_system_prompt_len)]
        for _ in range(args.gsp_prompts_per_group):
            question = [rng.randrange(FIRST_ID, VOCAB) for _ in range(args.gsp_question_len)]
            out.append(Request(system + question, args.gsp_output_len))
    rng.shuffle(out)
    return out


def random_dataset(args: argparse.Namespace, rng: random.Random) -> list[Request]:
    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - args.random_range_ratio)), n))

    return [
        Request([rng.randrange(FIRST_ID, VOCAB) for _ in range(length(args.random_input_len))],
                length(args.random_output_len))
        for _ in range(args.num_prompts)
    ]  # fmt: skip


# -- statistics ----------------------------------------------------------------------------------
def _dist(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(values) * scale, "median": statistics.median(values) * scale,
            "p99": p99 * scale}  # fmt: skip


def summarize(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_len for o in ok)
    output = sum(o.output_len for o in ok)
    tpot = [(o.e2e - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    return {
        "completed": len(ok), "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": wall, "request_throughput": len(ok) / wall,
        "input_throughput": prompt / wall, "output_throughput": output / wall,
        "total_token_throughput": (prompt + output) / wall,
        "total_input_tokens": prompt, "total_output_tokens": output,
        "cache_hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "ttft_ms": _dist([o.ttft for o in ok]), "tpot_ms": _dist(tpot),
        "itl_ms": _dist([g for o in ok for g in o.itl]), "e2e_latency_ms": _dist([o.e2e for o in ok]),
    }  # fmt: skip


def report(name: str, s: dict[str, Any]) -> str:
    lines = [f"== {name}: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f}s",
             f"   throughput: {s['request_throughput']:.2f} req/s, output {s['output_throughput']:.1f} tok/s, "
             f"input {s['input_throughput']:.1f} tok/s; cache hit rate {s['cache_hit_rate']:.3f}"]  # fmt: skip
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        d = s[key]
        lines.append(f"   {key:15s} mean {d['mean']:9.1f}  median {d['median']:9.1f}  p99 {d['p99']:9.1f}")
    return "\n".join(lines + [f"   errors: {s['errors']}"] if s["errors"] else lines)
