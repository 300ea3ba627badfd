"""The suite: build the workloads from the traces, start each system in turn, run every workload at every
parallelism on it, and stop it before the next one starts (the systems never share the CPU)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.agents import multi_turn, rag, react, tool_loop, tot
from benchmarks.agents.backends import HFSide, LlamaCppSide, OpenVINOSide, RadixSide, Side, UrlSide
from benchmarks.agents.data import Corpus, Wikipedia, load_traces
from benchmarks.agents.runner import run_workload
from benchmarks.agents.workload import Scale, Workload

WORKLOADS = ("react", "react_live", "rag", "rag_verify", "multi_turn", "multi_turn_long", "tot", "tool_loop")


def build_workloads(data: Path, scale: Scale, names: list[str]) -> list[Workload]:
    traces = load_traces(data)
    all_: list[Workload] = [
        react.replay_workload(traces, scale),
        react.live_workload(traces, scale, Wikipedia(traces)),
    ]
    all_ += rag.workloads(traces, scale, Corpus.from_traces(traces))
    all_ += multi_turn.workloads(traces, scale)
    all_.append(tot.workload(traces, scale))
    all_.append(tool_loop.workload(traces, scale))
    by_name = {w.name: w for w in all_}
    return [by_name[n] for n in names]


def programs_for(parallel: int, args: argparse.Namespace) -> int:
    return max(parallel, args.min_programs) * args.waves


def side_factory(name: str, args: argparse.Namespace, log_dir: Path) -> Callable[[], Side]:
    from benchmarks.agents.backends import SERVER_FLAGS
    from radixrt.models.embedded import embedded_gguf_path
    from radixrt.models.resolve import resolve_model

    model_dir = resolve_model(args.model_path).path
    if name == "radixrt-engine":
        return lambda: RadixSide.engine(name, args.model_path, args.kv_tokens)
    if name in SERVER_FLAGS:
        return lambda: RadixSide.launch(name, args.model_path, args.kv_tokens, SERVER_FLAGS[name], log_dir)

    def gguf() -> Path:
        return Path(args.gguf) if args.gguf else embedded_gguf_path()

    if name == "llama.cpp":
        return lambda: LlamaCppSide(gguf(), model_dir, args.threads, args.llama_ctx, log_dir)
    if name == "openvino":
        return lambda: OpenVINOSide(gguf(), model_dir, args.threads)
    if name == "hf":
        return lambda: HFSide(model_dir, args.hf_dtype)
    if name == "url":
        return lambda: UrlSide(args.base_url, args.base_url_model, args.base_url_tokenizer or model_dir,
                               args.base_url_select, args.base_url_api_key)  # fmt: skip
    raise ValueError(f"unknown backend {name!r}")


def warm_up(side: Side, workloads: list[Workload]) -> None:
    """One program of the first workload, untimed (compiled kernels, first-use paths, page cache)."""
    wl = next((w for w in workloads if not w.needs_select or side.supports_select), None)
    if wl is not None:
        state = wl.program.run(backend=side.backend, temperature=0, **wl.take(1)[0])
        state.sync()


def run_suite(
    args: argparse.Namespace, workloads: list[Workload], on_run: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    log_dir = Path(args.log_dir)
    runs: list[dict[str, Any]] = []
    plan = []
    for backend in args.backends:
        par = [1] if backend == "hf" else args.parallel if backend in args.sweep_backends else [args.headline]
        for wl in workloads:
            for p in par:
                n = args.hf_programs if backend == "hf" else programs_for(p, args)
                plan.append((backend, wl, p, n))
    bar = tqdm(total=sum(n for *_, n in plan), desc="programs", unit="prog", dynamic_ncols=True)
    for backend in args.backends:
        bar.set_description(f"{backend}: starting")
        t0 = time.perf_counter()
        try:
            side = side_factory(backend, args, log_dir)()
        except Exception as exc:  # noqa: BLE001 - a missing system is reported, the others still run
            tqdm.write(f"{backend}: could not start: {type(exc).__name__}: {exc}")
            for b, wl, p, n in plan:
                if b == backend:
                    bar.update(n)
                    run = {"workload": wl.name, "backend": b, "parallel": p, "programs": n, "status": "error",
                           "errors": [f"start: {type(exc).__name__}: {str(exc)[-300:]}"]}  # fmt: skip
                    runs.append(run)
                    on_run(run)
            continue
        startup = time.perf_counter() - t0
        try:
            warm_up(side, workloads)
            for b, wl, p, n in plan:
                if b != backend:
                    continue
                bar.set_description(f"{backend} {wl.name} p{p}")
                try:
                    run = run_workload(side, wl, p, n, bar)
                except Exception as exc:  # noqa: BLE001 - e.g. a server that died: report, go on
                    run = {"workload": wl.name, "backend": backend, "parallel": p, "programs": n,
                           "status": "error", "errors": [f"{type(exc).__name__}: {str(exc)[-300:]}"]}  # fmt: skip
                run |= {"startup_s": startup, "system": side.describe()}
                runs.append(run)
                on_run(run)
                tqdm.write(_line(run))
        finally:
            side.close()
    bar.close()
    return runs


def _line(run: dict[str, Any]) -> str:
    head = f"{run['backend']:>14} {run['workload']:>15} p{run['parallel']:<2}"
    if run["status"] != "ok":
        return f"{head} {run['status']}: {run.get('reason') or '; '.join(run.get('errors', []))}"
    hit = run.get("hit_over_optimal")
    ttft = run.get("ttft_p99_s")
    return (f"{head} {run['programs_per_s']:.3f} prog/s  lat p50 {run['latency_p50_s']:.1f}s  "
            f"ttft p99 {ttft if ttft is None else round(ttft, 2)}s  hit/opt {hit if hit is None else round(hit, 3)}  "
            f"{run['tok_per_s']:.1f} tok/s")  # fmt: skip


def jsonl_writer(path: Path) -> Callable[[dict[str, Any]], None]:
    """Each finished run as one JSON line (the file starts empty for every invocation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("", encoding="utf-8")

    def write(run: dict[str, Any]) -> None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(run) + "\n")

    return write
