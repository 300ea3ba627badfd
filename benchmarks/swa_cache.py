"""Sliding-window-aware KV cache (issue 24): full cache vs ``--enable-swa-cache`` at one KV memory budget.

Run from the repo root::

    python -m benchmarks.swa_cache --readme          # the reported numbers
    python -m benchmarks.swa_cache --convs 4 --turns 4 --out /tmp/swa.json   # a quick look

Model: a tiny random-weight Gemma 3 (hidden 256, 6 layers, 5 local of a 512-token window per global one:
Gemma 3's pattern and window), float32, built once into the radixrt cache directory. Workload: multi-turn chat
(`benchmarks/prefix_workloads.py`): ``--convs`` conversations of ``--turns`` turns sharing a system prompt;
every turn's prompt is the previous one + the answer + a new user message, so conversations grow to
7k tokens (4 x 8 turns by default). Calls go round-robin (turn k of every conversation, then turn k+1), ``--concurrency`` at a time:
many users taking turns, each coming back after the others.

Budget: ``--budget-fraction`` of the working set (the union trie of every prompt and answer) in the full
cache's KV bytes. The full cache holds budget / (bytes per token of all layers) tokens; the window-aware cache
holds budget / (bytes of the global layers + ratio x bytes of the local layers) tokens in the global layers'
pool and ratio x that in the local layers' pool (``--ratios``), the same bytes. Reported per configuration:

- KV bytes held per cached token: the K/V the cache holds for the tokens in its tree at the end (all layers
  for the full cache; the global layers for every token plus the local layers for the share of tokens whose
  local K/V is still there), and the budget over the tokens the tree caches at the end;
- hit rate: prompt tokens served from the cache / prompt tokens;
- recomputed (window evicted): prompt tokens whose global K/V was cached but that were computed again because
  the local K/V of their window was freed (``swa_recomputed_tokens``), / prompt tokens;
- outputs equal to the full cache's (greedy; fp32 batches of another composition may flip a near-tie).

Results: ``benchmarks/results/swa_cache.json``; with ``--readme`` the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, format_table, machine_info, update_readme_section, write_json
from benchmarks.kv_tiers import _generate
from benchmarks.prefix_workloads import Workload, dry_run_sequences, multi_turn_chat, union_size
from radixrt import Engine
from radixrt.mem_cache.kv_pool import KVPool
from radixrt.testing.random_checkpoint import cache_dir, make_checkpoint

LAYERS, WINDOW = 6, 512


def gemma3_checkpoint() -> Path:
    """The tiny Gemma 3 with a 5:1 local:global pattern and a 512-token window (built once)."""
    path = cache_dir() / "bench" / f"gemma3-tiny-{LAYERS}l-w{WINDOW}-ctx8192"
    if not (path / "model.safetensors").is_file():
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(LAYERS)]
        make_checkpoint(
            path, arch="gemma3", size="tiny", seed=0, num_hidden_layers=LAYERS, layer_types=types,
            sliding_window=WINDOW, max_position_embeddings=8192,
        )  # fmt: skip
    return path


def _snapshot(s: Any) -> dict[str, int]:
    """The worker's cache state (runs on the scheduler thread)."""
    tree, kv = s.tree, s.kv
    swa = kv.swa_tree
    return {
        "cached": tree.total_size(),
        "swa_held": swa.swa_evictable_size() + swa.swa_protected_size() if swa is not None else -1,
        "swa_evicted": swa.swa_evicted_tokens if swa is not None else 0,
        "swa_recomputed": kv.swa_recomputed_tokens,
    }


async def _rounds(
    eng: Engine, wl: Workload, concurrency: int
) -> tuple[list[dict[str, Any]], list[dict[str, int]]]:
    """Turn k of every conversation, then turn k + 1; a cache snapshot after every round."""
    sem = asyncio.Semaphore(concurrency)
    prompts: list[list[int]] = [[] for _ in wl.chains]
    answers: list[list[int]] = [[] for _ in wl.chains]
    records: list[dict[str, Any]] = []
    snaps: list[dict[str, int]] = []

    async def one(i: int, k: int) -> None:
        call = wl.chains[i][k]
        prompt = prompts[i] + (answers[i] if call.carry_answer else []) + call.append
        async with sem:
            out, meta, _ = await _generate(eng, prompt, call.max_new_tokens)
        prompts[i], answers[i] = prompt, out
        records.append({"chain": i, "call": k, "prompt_len": len(prompt), "output": out,
                        "cached": meta["cached_tokens"]})  # fmt: skip

    turns = max(len(c) for c in wl.chains)
    for k in range(turns):
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, k) for i, c in enumerate(wl.chains) if k < len(c)))
        snaps.append(eng.worker.call(_snapshot))
        done = [r for r in records if r["call"] == k]
        print(f"  turn {k + 1}/{turns}: prompts {min(r['prompt_len'] for r in done)}-"
              f"{max(r['prompt_len'] for r in done)} tokens, cached {sum(r['cached'] for r in done)} of "
              f"{sum(r['prompt_len'] for r in done)}, {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)  # fmt: skip
    return records, snaps


def run_config(model: Path, wl: Workload, label: str, kv_tokens: int, args: argparse.Namespace,
               **kw: Any) -> dict[str, Any]:  # fmt: skip
    print(f"{label}: {kv_tokens} tokens in the {'global layers' if kw else 'full'} pool", file=sys.stderr)
    eng = Engine(
        model_path=str(model), max_total_tokens=kv_tokens, max_running_requests=args.concurrency,
        dtype="float32", chunked_prefill_size=args.chunked_prefill_size, **kw,
    )  # fmt: skip
    eng.worker.call(lambda s: torch.set_num_threads(args.threads))
    try:
        before = eng.get_server_info()
        t0 = time.perf_counter()
        records, snaps = asyncio.run(_rounds(eng, wl, args.concurrency))
        wall = time.perf_counter() - t0
        after = eng.get_server_info()
        eng.check_invariant()
    finally:
        eng.shutdown()
        gc.collect()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return {"config": label, "kv_tokens": kv_tokens, "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_prefill_tokens": after["computed_prefill_tokens"] - before["computed_prefill_tokens"],
            "hit_rate": cached / prompt, "swa_recomputed_tokens": snaps[-1]["swa_recomputed"],
            "recomputed_window_share": snaps[-1]["swa_recomputed"] / prompt, "snapshots": snaps,
            "wall_s": wall, "records": records}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = gemma3_checkpoint()
    wl = multi_turn_chat(
        args.convs, args.turns, args.system_len, args.user_len, args.output_len, 8000, args.seed
    )
    working_set = union_size(dry_run_sequences(wl))
    per_layer = KVPool.bytes_per_token(1, 2, 32, torch.float32)  # tiny: 2 KV heads of 32
    n_local = LAYERS - LAYERS // 6
    full_bpt = per_layer * LAYERS
    budget = int(max(args.budget_fraction * working_set, 1.5 * wl.max_seq_len()) * full_bpt)  # fits a call
    print(f"working set {working_set} tokens; budget {budget / 2**20:.1f} MiB; longest call "
          f"{wl.max_seq_len()} tokens", file=sys.stderr)  # fmt: skip
    runs = [run_config(model, wl, "full", budget // full_bpt, args)]
    for ratio in args.ratios:
        tokens = int(budget // (per_layer * (LAYERS - n_local + ratio * n_local)))
        r = run_config(model, wl, f"swa r={ratio:g}", tokens, args, enable_swa_cache=True,
                       swa_full_tokens_ratio=ratio)  # fmt: skip
        last = r["snapshots"][-1]
        r["swa_evicted_tokens"] = last["swa_evicted"]
        r["local_kv_held_share"] = last["swa_held"] / last["cached"]  # of the cached tokens, at the end
        runs.append(r)
    for r in runs:  # the budget over what the tree caches at the end (the pools are full by then)
        r["kv_bytes_per_cached_token"] = budget / r["snapshots"][-1]["cached"]
    base = {(x["chain"], x["call"]): x["output"] for x in runs[0]["records"]}
    for r in runs:
        r["outputs_equal_full"] = sum(base[(x["chain"], x["call"])] == x["output"] for x in r["records"])
        r["calls"] = len(r["records"])
    return {"machine": machine_info(args.threads), "model": {"layers": LAYERS, "local": n_local, "window": WINDOW,
            "hidden": 256, "kv_heads": 2, "head_dim": 32, "dtype": "float32"}, "workload": wl.params,
            "working_set_tokens": working_set, "budget_bytes": budget, "budget_fraction": args.budget_fraction,
            "chunked_prefill_size": args.chunked_prefill_size, "concurrency": args.concurrency, "runs": runs}  # fmt: skip


def held_bytes_per_token(result: dict[str, Any], run: dict[str, Any]) -> float:
    """K/V bytes the cache holds per token in its tree at the end: all layers' for the full cache; the global
    layers' plus the local layers' for the share of tokens whose local K/V is still there."""
    m = result["model"]
    per_layer = KVPool.bytes_per_token(1, m["kv_heads"], m["head_dim"], torch.float32)
    share = run.get("local_kv_held_share", 1.0)
    return per_layer * (m["layers"] - m["local"] + m["local"] * share)


def table(result: dict[str, Any]) -> str:
    rows = []
    for r in result["runs"]:
        rows.append([
            r["config"], str(r["kv_tokens"]), f"{held_bytes_per_token(result, r):.0f}",
            f"{r['kv_bytes_per_cached_token']:.0f}", f"{r['hit_rate']:.1%}",
            f"{r['recomputed_window_share']:.1%}", f"{r['computed_prefill_tokens']}",
            f"{r['outputs_equal_full']}/{r['calls']}", f"{r['wall_s']:.0f}",
        ])  # fmt: skip
    heads = ["cache", "tokens (global pool)", "KV bytes held / cached token", "budget / cached token", "hit rate",
             "recomputed (window evicted)", "computed prefill tokens", "outputs = full", "wall s"]  # fmt: skip
    return format_table(heads, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--convs", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=800)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--budget-fraction", type=float, default=0.4, help="KV bytes = this x working set (full)")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.27], help="local / global pool tokens")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "swa_cache.json")
    p.add_argument("--readme", action="store_true")
    p.add_argument("--table-only", action="store_true", help="print (and with --readme write) --out's table")
    args = p.parse_args()
    if args.table_only:
        result = json.loads(args.out.read_text())
    else:
        result = run(args)
        write_json(args.out, result)
    md = table(result)
    print(md)
    if args.readme:
        w = result["workload"]
        head = (f"`python -m benchmarks.swa_cache --readme` ({result['machine']['date'][:10]}, "
                f"{result['machine']['torch_threads']} threads): tiny Gemma 3 (6 layers, 5 local of a 512-token window per global), "
                f"fp32; {w['convs']} chat conversations x {w['turns']} turns (system {w['system_len']}, user "
                f"{w['user_len']}, answers {w['output_len']} tokens: conversations of "
                f"{w['system_len'] + w['user_len'] + w['output_len']}-"
                f"{w['system_len'] + w['turns'] * (w['user_len'] + w['output_len'])} tokens), round-robin, "
                f"{result['concurrency']} at a time; KV budget {result['budget_bytes'] / 2**20:.1f} MiB = "
                f"{result['budget_fraction']:g} x the working set of {result['working_set_tokens']} tokens in the full "
                "cache's bytes.")  # fmt: skip
        update_readme_section("swa_cache", head + "\n\n" + md)


if __name__ == "__main__":
    main()
