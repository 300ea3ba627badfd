"""The C extend-attention kernel against the gather + SDPA reference path, side by side.

``python -m benchmarks.extend_attention [--threads 2] [--repeats 7] [--dtypes bfloat16,float32]``:

1. per layer: ``TorchNativeBackend`` with the embedded model's attention shape (9 heads, 3 KV heads, head dim
   64) on a KV pool, one layer's ``forward`` (K/V store included; ``init_forward_metadata``, once per forward,
   timed apart), for an extend of 256 tokens over a 3,072-token cached prefix and a 512-token prefill;
   kernel and reference interleaved;
2. the Engine on the embedded model (defaults: ``gguf`` blocks, bf16): an extend of 256 new tokens over a
   3,072-token cached prefix and a 512-token prefill, one generated token each, the kernel switched on and
   off between runs of the same engine (``backend.use_extend_kernel``).

Each figure is the min / median over ``--repeats`` interleaved runs (the machine is shared: medians move).
The results go to ``benchmarks/results/extend_attention.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, format_table, machine_info, write_json

H, KVH, D = 9, 3, 64  # SmolLM2-135M's attention
PREFIX, EXTEND, PREFILL = 3072, 256, 512


def interleaved(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, dict[str, float]]:
    """Run each variant once per round, ``repeats`` rounds; min and median seconds of each."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(run())
    return {name: {"min_s": min(t), "median_s": statistics.median(t)} for name, t in times.items()}


def layer_runs(dtype: torch.dtype, prefix: int, extend: int) -> dict[str, Callable[[], float]]:
    """One attention layer of an extend forward through the kernel and through the reference path, and the
    reference's per-forward metadata (slot table, mask)."""
    from radixrt.kernels.base import AttentionMetadata, ForwardMode
    from radixrt.kernels.torch_native import TorchNativeBackend
    from radixrt.mem_cache.kv_pool import KVPool

    seq = prefix + extend
    pool = KVPool(seq + 64, 1, KVH, D, dtype)
    g = torch.Generator().manual_seed(0)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=g))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=g))
    slots = torch.arange(1, seq + 1)
    md = AttentionMetadata(
        mode=ForwardMode.EXTEND,
        qo_indptr=torch.tensor([0, extend]),
        kv_indptr=torch.tensor([0, seq]),
        kv_indices=slots,
        kv_last_page_len=torch.tensor([1]),
        page_size=1,
        prefix_lens=torch.tensor([prefix]),
        seq_lens=torch.tensor([seq]),
        out_cache_loc=slots[prefix:],
        max_extend_len=extend,
        max_seq_len=seq,
        slot_table=slots[None, :],
    )
    q = torch.randn(extend, H, D, generator=g).to(dtype)
    k = torch.randn(extend, KVH, D, generator=g).to(dtype)
    v = torch.randn(extend, KVH, D, generator=g).to(dtype)

    def run(backend: TorchNativeBackend, metadata: bool = False) -> Callable[[], float]:
        def once() -> float:
            t0 = time.perf_counter()
            backend.init_forward_metadata(md)
            t1 = time.perf_counter()
            backend.forward(q, k, v, 0, md)
            return t1 - t0 if metadata else time.perf_counter() - t1

        once()  # warm up (scratch buffers, the OpenMP pool)
        return once

    kernel = TorchNativeBackend(pool, H, KVH, D, D**-0.5, use_extend_kernel=True)
    reference = TorchNativeBackend(pool, H, KVH, D, D**-0.5, use_extend_kernel=False)
    assert kernel.use_extend_kernel, "the C kernels are unavailable here"
    return {"kernel": run(kernel), "gather+SDPA": run(reference), "metadata": run(reference, metadata=True)}


def use_c_kernel(backend: Any, on: bool) -> None:
    """Route every extend of ``backend`` through the C kernel (``on``) or gather + SDPA."""
    from radixrt.kernels.torch_native import C_EXTEND_ALWAYS

    backend.use_extend_kernel, backend.extend_kernel_max = on, C_EXTEND_ALWAYS


def engine_runs(repeats: int) -> dict[str, dict[str, dict[str, float]]]:
    """The Engine on the embedded model: extend over a cached prefix, and a fresh prefill."""
    from radixrt import Engine

    eng = Engine(model_path=None, max_total_tokens=PREFIX + (EXTEND + PREFILL) * 4 * repeats + 4096)
    vocab = eng.worker.scheduler.runner.config.vocab_size
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    system = tokens(PREFIX)
    params: dict[str, Any] = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    eng.generate(input_ids=system, sampling_params=params)  # the cached prefix

    def timed(ids: list[int], kernel: bool) -> float:
        eng.worker.call(lambda s: use_c_kernel(s.runner.backend, kernel))
        t0 = time.perf_counter()
        out = eng.generate(input_ids=ids, sampling_params=params)
        elapsed = time.perf_counter() - t0
        if len(ids) > PREFIX:
            assert out["meta_info"]["cached_tokens"] >= PREFIX - 1, "the prefix was not cached"
        return elapsed

    for kernel in (True, False):  # warm both paths
        timed(system + tokens(EXTEND), kernel)
        timed(tokens(PREFILL), kernel)
    try:
        return {
            f"extend {EXTEND} over {PREFIX}": interleaved(
                {
                    "kernel": lambda: timed(system + tokens(EXTEND), True),
                    "gather+SDPA": lambda: timed(system + tokens(EXTEND), False),
                },
                repeats,
            ),
            f"prefill {PREFILL}": interleaved(
                {
                    "kernel": lambda: timed(tokens(PREFILL), True),
                    "gather+SDPA": lambda: timed(tokens(PREFILL), False),
                },
                repeats,
            ),
        }
    finally:
        eng.shutdown()


def rows_of(results: dict[str, dict[str, dict[str, float]]]) -> list[list[str]]:
    def ms(t: dict[str, float]) -> str:
        return f"{t['min_s'] * 1e3:.2f} / {t['median_s'] * 1e3:.2f}"

    rows = []
    for case, variants in results.items():
        ref, ker = variants["gather+SDPA"], variants["kernel"]
        meta = ms(variants["metadata"]) if "metadata" in variants else "-"
        rows.append([case, ms(ker), ms(ref), meta, f"{ref['min_s'] / ker['min_s']:.2f}x"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    p.add_argument("--repeats", type=int, default=15, help="interleaved runs of each variant")
    p.add_argument("--dtypes", default="bfloat16,float32", help="KV dtypes of the per-layer figures")
    p.add_argument("--skip-engine", action="store_true", help="per-layer figures only")
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)  # the Engine's worker threads (radixrt/worker/threads.py)
    layer: dict[str, dict[str, dict[str, float]]] = {}
    for name in ns.dtypes.split(","):
        dtype = getattr(torch, name)
        for prefix, extend in ((PREFIX, EXTEND), (0, PREFILL)):
            case = f"{name}, extend {extend} over {prefix}" if prefix else f"{name}, prefill {extend}"
            layer[case] = interleaved(layer_runs(dtype, prefix, extend), ns.repeats)
    headers = ["case", "kernel min / median ms", "gather+SDPA min / median ms", "its metadata ms", "speedup"]
    print(
        "One attention layer (store K/V + attend; the reference path builds its metadata once per forward):"
    )
    print(format_table(headers, rows_of(layer)))
    result: dict[str, Any] = {"machine": machine_info(ns.threads), "repeats": ns.repeats, "layer": layer}
    if not ns.skip_engine:
        engine = engine_runs(ns.repeats)
        print("\nEngine, embedded model (defaults), one generated token:")
        print(format_table(headers, rows_of(engine)))
        result["engine"] = engine
    print(f"\nwrote {write_json(RESULTS_DIR / 'extend_attention.json', result)}")


if __name__ == "__main__":
    main()
