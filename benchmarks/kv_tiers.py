"""KV memory hierarchy benchmark (issue 14): host and disk tiers under a small device pool, a restart
served from disk, FP8 vs bf16 KV capacity, and FP8 quality on the real model.

Run from the repo root::

    python -m benchmarks.kv_tiers --readme                      # the reported numbers (~10-15 min)
    python -m benchmarks.kv_tiers --chat-convs 8 --react-traces 4 --skip-quality --out /tmp/kt.json --plot /tmp/kt.png

Workloads (``benchmarks/prefix_workloads.py``): multi-turn chat (every turn = previous prompt + answer +
a new user message) and ReAct (the HotpotQA traces at ``--data``, else synthetic chains of that shape: a
shared few-shot header, then one call per step on the growing scratchpad). Calls go round-robin over
the conversations (turn k of every conversation, then turn k+1), ``--concurrency`` at a time: the access
pattern of many users taking turns, where LRU over a pool smaller than the working set keeps evicting
exactly what comes back next. The device pool is ``--device-fraction`` (1/8) of the working set (the
union trie of every prompt and answer; never below what the longest call needs). Configurations on the
same engine settings:

- ``none``: the RadixCache alone;
- ``host``: ``--enable-hierarchical-cache`` with a host pool of ``--host-ratio`` x the device pool
  (default 8: the host holds the working set, as host RAM does for a GPU's HBM);
- ``host+disk``: a host pool of ``--disk-host-ratio`` (2, SGLang's default) plus the disk tier;
- ``restart``: a new engine on the ``host+disk`` directory re-sends every conversation's last prompt, one
  at a time, against the same prompts on a cold engine without tiers (recompute).

Per run: prefill recompute rate (computed prefill tokens / prompt tokens), hits by tier, TTFT p50/p99
(streamed first token, queueing included), wall time; outputs must equal ``none``'s (the tiers are
lossless). FP8 capacity: the chat workload with a fixed KV byte budget (bf16 model, ``--fp8-budget``
of the working set in bf16 bytes), bf16 KV vs fp8_e4m3 KV (twice the tokens). FP8 quality:
``benchmarks/kv_tiers_fp8.py``. Results: ``benchmarks/results/kv_tiers.json``, ``kv_tiers.png``,
with ``--readme`` the table in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, bench_checkpoint, machine_info, write_json
from benchmarks.prefix_workloads import (
    Workload,
    dry_run_sequences,
    multi_turn_chat,
    react_from_data,
    react_synthetic,
    union_size,
)
from benchmarks.react_traces import DATA_SOURCE, data_label, traces_file
from radixrt import Engine
from radixrt.mem_cache.kv_pool import KVPool
from radixrt.models.tokenizer import load_tokenizer

COUNTERS = (
    "prompt_tokens",
    "cached_tokens",
    "cached_tokens_device",
    "cached_tokens_host",
    "cached_tokens_disk",
    "computed_prefill_tokens",
    "retractions",
    "num_finished",
)
TARGET_HOST_RECOMPUTE = 1 / 3  # host-tier recompute rate <= this x the no-tier rate (chat, 1/8 memory)
TARGET_RESTART_COMPUTED = 0.05  # after a restart: computed share of a cached conversation's prompt


def build_workloads(args: argparse.Namespace, model_dir: Path, vocab: int) -> list[Workload]:
    chat = multi_turn_chat(
        args.chat_convs, args.chat_turns, args.chat_system_len, args.chat_user_len, 32, vocab, args.seed
    )
    if args.data is not None:
        react = react_from_data(args.data, load_tokenizer(str(model_dir)), args.react_traces, 1, 16)
    else:
        react = react_synthetic(args.react_traces, 1024, 16, vocab, args.seed)
    return [chat, react]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def _generate(eng: Engine, prompt: list[int], max_new: int) -> tuple[list[int], dict[str, Any], float]:
    """Stream one request; returns (output ids, final meta info, seconds to the first token)."""
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    stream = await eng.async_generate(input_ids=prompt, sampling_params=params, stream=True)
    async for out in stream:
        if ttft is None and out["output_ids"]:
            ttft = time.perf_counter() - t0
        last = out
    if last["meta_info"]["finish_reason"]["type"] == "abort":
        raise RuntimeError(f"request aborted: {last['meta_info']['finish_reason']}")
    return last["output_ids"], last["meta_info"], ttft if ttft is not None else time.perf_counter() - t0


async def _round_robin(eng: Engine, wl: Workload, concurrency: int) -> list[dict[str, Any]]:
    """Call k of every chain, then call k + 1, ``concurrency`` requests in flight; one record per call."""
    sem = asyncio.Semaphore(concurrency)
    prompts: list[list[int]] = [[] for _ in wl.chains]
    answers: list[list[int]] = [[] for _ in wl.chains]
    records: list[dict[str, Any]] = []

    async def one(i: int, k: int) -> None:
        call = wl.chains[i][k]
        prompt = prompts[i] + (answers[i] if call.carry_answer else []) + call.append
        async with sem:
            out, meta, ttft = await _generate(eng, prompt, call.max_new_tokens)
        prompts[i], answers[i] = prompt, out
        records.append({"chain": i, "call": k, "prompt": prompt, "ttft": ttft, "output": out,
                        "cached": meta["cached_tokens"], "details": meta.get("cached_tokens_details")})  # fmt: skip

    for k in range(max(len(c) for c in wl.chains)):
        await asyncio.gather(*(one(i, k) for i, c in enumerate(wl.chains) if k < len(c)))
    return records


def _engine(model_dir: Path, kv_tokens: int, args: argparse.Namespace, **kw: Any) -> Engine:
    eng = Engine(
        model_path=str(model_dir),
        max_total_tokens=kv_tokens,
        max_running_requests=args.concurrency,
        dtype=kw.pop("dtype", "float32"),
        chunked_prefill_size=args.chunked_prefill_size,
        **kw,
    )
    eng.worker.call(lambda s: torch.set_num_threads(args.threads))
    return eng


def run_config(
    model_dir: Path, wl: Workload, kv_tokens: int, label: str, args: argparse.Namespace, **kw: Any
) -> dict[str, Any]:
    eng = _engine(model_dir, kv_tokens, args, **kw)
    try:
        before = eng.get_server_info()
        t0 = time.perf_counter()
        records = asyncio.run(asyncio.wait_for(_round_robin(eng, wl, args.concurrency), args.run_timeout))
        wall = time.perf_counter() - t0
        after = eng.get_server_info()
        eng.check_invariant()
    finally:
        eng.shutdown()
        gc.collect()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    ttfts = [r["ttft"] for r in records]
    tiers = {
        k: after[k]
        for k in ("kv_host_total_tokens", "host_load_tokens", "disk_tokens", "disk_bytes")
        if k in after
    }
    return {
        "workload": wl.name,
        "config": label,
        "kv_tokens": kv_tokens,
        **delta,
        **tiers,
        "recompute_rate": delta["computed_prefill_tokens"] / delta["prompt_tokens"],
        "hit_rate": delta["cached_tokens"] / delta["prompt_tokens"],
        "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
        "wall_s": wall,
        "records": records,
    }


def run_restart(
    model_dir: Path, wl: Workload, kv_tokens: int, store: Path, prev: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Re-send every chain's last prompt to a new engine on ``store``, one at a time, then to a cold
    engine without tiers (recompute)."""
    last: dict[int, dict[str, Any]] = {}
    for r in prev["records"]:
        if r["call"] >= last.get(r["chain"], {"call": -1})["call"]:
            last[r["chain"]] = r
    prompts = [r["prompt"] for _, r in sorted(last.items())]
    out: dict[str, Any] = {"workload": wl.name, "prompts": len(prompts)}
    sides = (
        ("disk", {"enable_hierarchical_cache": True, "hicache_ratio": args.disk_host_ratio, "hicache_storage_dir": str(store)}),
        ("recompute", {}),
    )  # fmt: skip
    for side, kw in sides:
        eng = _engine(model_dir, kv_tokens, args, **kw)
        try:
            t_start = time.perf_counter()
            rows = [asyncio.run(_generate(eng, p, 1)) for p in prompts]
            wall = time.perf_counter() - t_start
            eng.check_invariant()
        finally:
            eng.shutdown()
        computed = [
            (len(p) - m["cached_tokens"]) / len(p) for p, (_, m, _) in zip(prompts, rows, strict=True)
        ]
        ttft = [t for _, _, t in rows]
        out[side] = {
            "computed_share_mean": statistics.mean(computed),
            "computed_share_max": max(computed),
            "disk_hit_tokens": sum((m.get("cached_tokens_details") or {}).get("disk", 0) for _, m, _ in rows),
            "prompt_tokens": sum(len(p) for p in prompts),
            "ttft_p50_ms": 1000 * percentile(ttft, 0.5),
            "ttft_p99_ms": 1000 * percentile(ttft, 0.99),
            "wall_s": wall,
        }
    out["ttft_speedup_p50"] = out["recompute"]["ttft_p50_ms"] / out["disk"]["ttft_p50_ms"]
    return out


def run_fp8_capacity(model_dir: Path, wl: Workload, ws: int, args: argparse.Namespace) -> dict[str, Any]:
    """Hit rate of the chat workload under one KV byte budget: bf16 KV vs fp8_e4m3 KV (bf16 model)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    dims = (
        cfg["num_hidden_layers"],
        cfg["num_key_value_heads"],
        cfg["hidden_size"] // cfg["num_attention_heads"],
    )
    budget = int(args.fp8_budget * ws) * KVPool.bytes_per_token(*dims, torch.bfloat16)
    floor = wl.max_seq_len() + 256
    out: dict[str, Any] = {"budget_bytes": budget, "budget_over_ws_bf16": args.fp8_budget}
    for kvd, dtype in (("auto", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        tokens = max(budget // KVPool.bytes_per_token(*dims, dtype), floor)
        res = run_config(
            model_dir, wl, tokens, f"bf16 model, kv {kvd}", args, dtype="bfloat16", kv_cache_dtype=kvd
        )
        res.pop("records")
        out["bf16" if kvd == "auto" else "fp8_e4m3"] = res
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model_dir = bench_checkpoint(args.size, context=8192)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    vocab = min(vocab, len(load_tokenizer(str(model_dir))))
    result: dict[str, Any] = {
        "benchmark": "kv_tiers",
        "meta": machine_info(args.threads),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"data": data_label(args.data)},
        "workloads": {},
        "runs": [],
        "restart": [],
    }
    for wl in build_workloads(args, model_dir, vocab):
        ws = union_size(dry_run_sequences(wl))
        kv = max(int(ws * args.device_fraction), wl.max_seq_len() + 256)
        result["workloads"][wl.name] = {"params": wl.params, "calls": wl.num_calls, "working_set_tokens": ws,
                                        "device_tokens": kv, "device_over_ws": kv / ws}  # fmt: skip
        store = Path(tempfile.mkdtemp(prefix="kv_tiers_disk_"))
        try:
            configs = (
                ("none", {}),
                ("host", {"enable_hierarchical_cache": True, "hicache_ratio": args.host_ratio}),
                ("host+disk", {"enable_hierarchical_cache": True, "hicache_ratio": args.disk_host_ratio,
                               "hicache_storage_dir": str(store)}),
            )  # fmt: skip
            runs = []
            for label, kw in configs:
                res = run_config(model_dir, wl, kv, label, args, **kw)
                runs.append(res)
                print(f"{wl.name:5s} {label:10s} kv={kv} recompute={res['recompute_rate']:.3f} "
                      f"ttft p50={res['ttft_p50_ms']:.0f} ms wall={res['wall_s']:.1f}s", flush=True)  # fmt: skip
            restart = run_restart(model_dir, wl, kv, store, runs[-1], args)
            print(f"{wl.name:5s} restart: computed share max={restart['disk']['computed_share_max']:.3f} "
                  f"ttft x{restart['ttft_speedup_p50']:.1f}", flush=True)  # fmt: skip
            result["restart"].append(restart)
        finally:
            shutil.rmtree(store, ignore_errors=True)
        ref = [r["output"] for r in sorted(runs[0]["records"], key=lambda r: (r["chain"], r["call"]))]
        for res in runs:
            mine = [r["output"] for r in sorted(res["records"], key=lambda r: (r["chain"], r["call"]))]
            res["outputs_identical_to_none"] = mine == ref
            res.pop("records")
            result["runs"].append(res)
        if wl.name == "chat" and not args.skip_capacity:
            result["fp8_capacity"] = run_fp8_capacity(model_dir, wl, ws, args)
    result["targets"] = targets(result)
    write_json(args.out, result)  # the tier results survive a failure of the quality part
    if not args.skip_quality:
        from benchmarks.kv_tiers_fp8 import fp8_quality

        result["fp8_quality"] = fp8_quality(traces_file(args.data), args.quality_prompts, args.quality_texts)
    result["targets"] = targets(result)
    return result


def targets(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    by = {(r["workload"], r["config"]): r for r in result["runs"]}
    if ("chat", "none") in by:
        ratio = by[("chat", "host")]["recompute_rate"] / by[("chat", "none")]["recompute_rate"]
        out["host_recompute_over_none_chat"] = {"value": ratio, "target": TARGET_HOST_RECOMPUTE,
                                                "met": ratio <= TARGET_HOST_RECOMPUTE}  # fmt: skip
    for r in result["restart"]:
        v = r["disk"]["computed_share_max"]
        out[f"restart_computed_share_max_{r['workload']}"] = {
            "value": v, "target": TARGET_RESTART_COMPUTED, "met": v <= TARGET_RESTART_COMPUTED
        }  # fmt: skip
    q = result.get("fp8_quality")
    if q is not None:
        out.update(q["targets"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=["tiny", "88m"])
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help=f"{DATA_SOURCE}. Default: synthetic token chains of the same shape for the tiers, synthetic "
        "traces (benchmarks/react_traces.py) for the FP8 perplexity texts",
    )
    p.add_argument("--chat-convs", type=int, default=32)
    p.add_argument("--chat-turns", type=int, default=6)
    p.add_argument("--chat-system-len", type=int, default=256)
    p.add_argument("--chat-user-len", type=int, default=64)
    p.add_argument("--react-traces", type=int, default=24)
    p.add_argument("--device-fraction", type=float, default=1 / 8)
    p.add_argument("--host-ratio", type=float, default=8.0, help="host pool / device pool, config 'host'")
    p.add_argument("--disk-host-ratio", type=float, default=2.0, help="host pool / device pool, with disk")
    p.add_argument("--fp8-budget", type=float, default=0.25, help="KV bytes = this x working set in bf16")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout", type=float, default=1800.0)
    p.add_argument("--skip-capacity", action="store_true")
    p.add_argument("--skip-quality", action="store_true", help="skip the real-model FP8 quality runs")
    p.add_argument("--quality-prompts", type=int, default=8, help="chat prompts x 128 greedy tokens")
    p.add_argument(
        "--quality-texts", type=int, default=16, help="ReAct texts (512 tokens each) for perplexity"
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "kv_tiers.json")
    p.add_argument("--plot", type=Path, default=RESULTS_DIR / "kv_tiers.png")
    p.add_argument("--readme", action="store_true")
    p.add_argument("--quality-only", action="store_true", help="rerun the FP8 quality part into --out's JSON")
    args = p.parse_args()
    if args.data is not None and not args.data.is_file():
        p.error(f"--data {args.data}: no such file")
    if args.quality_only:
        from benchmarks.kv_tiers_fp8 import fp8_quality

        result = json.loads(args.out.read_text())
        result["fp8_quality"] = fp8_quality(traces_file(args.data), args.quality_prompts, args.quality_texts)
        result["targets"] = targets(result)
    else:
        result = run(args)
    write_json(args.out, result)
    from benchmarks.kv_tiers_report import plot, print_summary, update_readme

    plot(result, args.plot)
    print_summary(result)
    if args.readme:
        update_readme(result)


if __name__ == "__main__":
    main()
