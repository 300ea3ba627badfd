"""The ``--quantization`` x ``--dtype`` matrix on one GGUF file: batch-1 decode and prefill tok/s per combination.

    python -m benchmarks.dtype_modes                          # embedded model, 2 threads, bf16 and fp32
    python -m benchmarks.dtype_modes --dtypes float32 --modes default gguf none --repeats 5

One Engine per combination (``default``: quantization unset, what radixrt picks for that dtype), one at a
time, defaults otherwise (compiled decode, ``--dense-gemm-min-tokens``); ``--set FIELD=VALUE`` adds a field
to every engine. Decode: a cached 64-token prompt generating 65 tokens against generating 1 (the difference
is 64 decode steps); prefill: ``--prefill`` fresh tokens. Best of ``--repeats``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

DTYPES = (
    "bfloat16",
    "float32",
    "float16",
)  # float16: reported as failing (the C attention kernels read fp32 / bf16)
MODES = ("default", "gguf", "none", "int8", "int4")


def measure(engine: Any, prefill: int, repeats: int, rng: random.Random) -> tuple[float, float]:
    """(batch-1 decode tok/s, prefill tok/s), best of ``repeats``."""
    vocab = engine.worker.scheduler.runner.config.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def timed(prompt: list[int], new: int) -> float:
        params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        t0 = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params=params)
        return time.perf_counter() - t0

    prompt = ids(64)
    timed(prompt, 65)  # warm-up; caches the prompt
    decode, pre = 0.0, 0.0
    for _ in range(repeats):
        one, many = timed(prompt, 1), timed(prompt, 65)
        decode = max(decode, 64 / max(many - one, 1e-9))
        engine.flush_cache()
        pre = max(pre, prefill / timed(ids(prefill), 1))
        timed(prompt, 1)
    return decode, pre


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=DTYPES)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ns = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)  # the worker reads it (radixrt/worker/threads.py)
    from radixrt import Engine

    extra: dict[str, Any] = {}
    for item in ns.set:
        field, _, value = item.partition("=")
        extra[field] = int(value) if value.lstrip("-").isdigit() else value
    rows = []
    for dtype in ns.dtypes:
        for mode in ns.modes:
            kw: dict[str, Any] = {"dtype": dtype, **extra}
            if mode != "default":
                kw["quantization"] = mode
            t0 = time.perf_counter()
            try:
                engine = Engine(model_path=ns.model_path, max_total_tokens=8192, **kw)
            except (ValueError, RuntimeError) as e:  # reported in the table, not skipped
                print(f"{dtype} {mode}: fails at startup: {e}", flush=True)
                rows.append((dtype, mode, f"fails: {str(e)[:80]}", 0.0, 0.0, time.perf_counter() - t0))
                continue
            startup = time.perf_counter() - t0
            try:
                resolved = engine.worker.scheduler.runner.quantization
                decode, pre = measure(engine, ns.prefill, ns.repeats, random.Random(0))
            finally:
                engine.shutdown()
            rows.append((dtype, mode, resolved, decode, pre, startup))
            print(f"{dtype} {mode} ({resolved}): decode {decode:.1f} tok/s, prefill {pre:.0f} tok/s, "
                  f"startup {startup:.0f} s", flush=True)  # fmt: skip
    print(f"\n{ns.threads} threads, best of {ns.repeats}")
    print(
        f"| --dtype | --quantization | runs | batch-1 decode tok/s | prefill {ns.prefill} tok/s | startup s |"
    )
    print("|---|---|---|---|---|---|")
    for dtype, mode, resolved, decode, pre, startup in rows:
        print(f"| {dtype} | {mode} | {resolved} | {decode:.1f} | {pre:.0f} | {startup:.0f} |")


if __name__ == "__main__":
    main()
