"""Cascade decode attention (a shared prefix attended once for the batch) against the C decode kernel alone.

``python -m benchmarks.cascade_decode [--threads 2] [--repeats 7] [--dtype bfloat16]``

One layer of the embedded model's attention shape (9 heads, 3 KV heads, head dim 64): B requests decoding
over a prefix of P shared pool slots plus 100 slots of their own, through
``cpu_decode.paged_decode_attention`` (every request reads the prefix) and through
``cpu_cascade.cascade_decode_attention`` (the prefix once, by SDPA, for all requests' queries), interleaved.
The step's plan (``plan_shared_prefix``, once per step, not per layer) is timed apart. Min / median
microseconds over ``--repeats`` rounds of 30 calls each; results in ``benchmarks/results/cascade_decode.json``.
"""

from __future__ import annotations  # noqa: I001 - radixrt first (below)

import radixrt  # noqa: F401 - before torch: bounds libgomp's spin-waiting (radixrt/worker/threads.py)
import argparse
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, format_table, machine_info, write_json
from radixrt.kernels import cpu_cascade, cpu_decode

H, KVH, D, OWN = 9, 3, 64, 100
CASES = [
    (2, 3000),
    (4, 500),
    (4, 1000),
    (4, 2000),
    (8, 250),
    (8, 500),
    (8, 1000),
    (8, 3000),
    (16, 500),
    (16, 3000),
]


def batch(requests: int, prefix: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k_buf, v_buf, slot_table, seq_lens: slots [1, 1 + prefix) shared, then OWN scattered slots each."""
    g = torch.Generator().manual_seed(requests * 7 + prefix)
    num_slots = 1 + prefix + requests * OWN
    k_buf = torch.randn(num_slots, KVH, D, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, KVH, D, generator=g).to(dtype)
    own = (torch.randperm(requests * OWN, generator=g) + 1 + prefix).view(requests, OWN)
    table = torch.cat([torch.arange(1, 1 + prefix).expand(requests, prefix), own], dim=1).contiguous()
    lens = torch.full((requests,), prefix + OWN, dtype=torch.int64)
    q = torch.randn(requests, H, D, generator=g).to(dtype)
    return q, k_buf, v_buf, table, lens


def case_runs(requests: int, prefix: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The three timed calls of one case: the kernel alone, the cascade, the step's plan."""
    q, k_buf, v_buf, table, lens = batch(requests, prefix, dtype)
    # the plan built directly: the planner declines fewer than MIN_SHARING requests, which this measures
    suffix = table[:, prefix:].contiguous()
    plan = cpu_cascade.SharedPrefix(
        1, prefix, torch.ones(requests, dtype=torch.bool), suffix, lens - prefix, None
    )
    return {
        "kernel": lambda: cpu_decode.paged_decode_attention(q, k_buf, v_buf, table, lens, D**-0.5),
        "cascade": lambda: cpu_cascade.cascade_decode_attention(q, k_buf, v_buf, plan, D**-0.5),
        "plan": lambda: cpu_cascade.plan_shared_prefix(table, lens, 1),
    }


def timed(fn: Callable[[], object], calls: int = 30) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows, results = [], []
    for requests, prefix in tqdm(CASES, desc="cascade_decode cases"):
        runs = case_runs(requests, prefix, dtype)
        for fn in runs.values():
            fn()  # warm
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                times[name].append(timed(fn))
        stats = {n: {"min_us": min(t), "median_us": statistics.median(t)} for n, t in times.items()}
        ratio = stats["kernel"]["median_us"] / stats["cascade"]["median_us"]
        results.append({"requests": requests, "prefix": prefix, "own": OWN, **stats, "speedup_median": ratio})
        rows.append([str(requests), str(prefix), f"{stats['kernel']['median_us']:.0f}",
                     f"{stats['cascade']['median_us']:.0f}", f"{ratio:.2f}x",
                     f"{stats['plan']['median_us']:.0f}"])  # fmt: skip
    headers = ["requests", "shared prefix", "kernel us", "cascade us", "kernel / cascade", "plan us (a step)"]
    print(format_table(headers, rows))
    out = {"machine": machine_info(args.threads), "dtype": args.dtype, "heads": [H, KVH, D], "cases": results}
    print(f"\nwrote {write_json(RESULTS_DIR / 'cascade_decode.json', out)}")


if __name__ == "__main__":
    main()
