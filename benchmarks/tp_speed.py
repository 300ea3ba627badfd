"""Tensor parallelism on CPU: decode and prefill tok/s at TP=1 and TP=2 (gloo), and the all-reduce share.

``python -m benchmarks.tp_speed [--readme]`` on the ~88M random Llama (float32, eager: TP runs eagerly).
The all-reduce share is the fraction of rank 0's decode time spent inside ``dist.all_reduce`` (waiting
for the other rank included: on one machine the ranks share cores, so this is an upper bound on the
communication cost). On this 2-core machine TP=2 cannot be faster than TP=1 — both ranks share the
same cores and memory bandwidth; the benchmark shows the cost of the collectives, not a speed-up.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from benchmarks.common import (
    RESULTS_DIR,
    bench_checkpoint,
    format_table,
    machine_info,
    update_readme_section,
    write_json,
)
from benchmarks.cpu_systems import RadixSystem


def _timed_all_reduce(sched: Any, box: dict[str, float]) -> None:
    """Wrap rank 0's all-reduce to accumulate its seconds in ``box``."""
    import radixrt.distributed.tensor_parallel as tp

    inner = dist.all_reduce

    def timed(t: torch.Tensor, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(t, *a, **kw)
        box["s"] += time.perf_counter() - t0
        return out

    tp.dist.all_reduce = timed  # type: ignore[attr-defined]


def measure(tp_size: int, batches: tuple[int, ...], new_tokens: int) -> dict[str, Any]:
    path = str(bench_checkpoint("88m"))
    rs = RadixSystem(f"tp{tp_size}", path, dtype="float32", disable_compile=True, tp_size=tp_size)
    box = {"s": 0.0}
    if tp_size > 1:
        rs.engine.worker.call(lambda s: _timed_all_reduce(s, box), timeout=60)
    out: dict[str, Any] = {"decode": {}, "all_reduce_share": {}, "startup_s": rs.startup_s}
    for b in batches:
        box["s"] = 0.0
        t0 = time.perf_counter()
        out["decode"][str(b)] = rs.decode_tok_s(b, 128, new_tokens)
        wall = time.perf_counter() - t0
        out["all_reduce_share"][str(b)] = box["s"] / wall if tp_size > 1 else 0.0
    out["prefill_512"] = rs.prefill_tok_s(512)
    rs.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--readme", action="store_true")
    ns = p.parse_args()
    batches = (1, 8)
    results = {f"TP={n}": measure(n, batches, ns.new_tokens) for n in tqdm((1, 2), desc="tp sizes")}
    write_json(
        RESULTS_DIR / "tp_speed.json", {"machine": machine_info(torch.get_num_threads()), "results": results}
    )
    rows = [[name] + [f"{r['decode'][str(b)]:.0f}" for b in batches] + [f"{r['prefill_512']:.0f}"]
            + [f"{100 * r['all_reduce_share'][str(b)]:.0f}%" for b in batches] for name, r in results.items()]  # fmt: skip
    head = [
        "",
        *[f"decode b{b} tok/s" for b in batches],
        "prefill 512 tok/s",
        *[f"all-reduce share b{b}" for b in batches],
    ]
    table = format_table(head, rows)
    print(table)
    if ns.readme:
        update_readme_section(
            "tp_speed", "88M random Llama, float32, eager, 2 cores shared by the ranks\n\n" + table
        )


if __name__ == "__main__":
    main()
