"""radixrt's AVX512-BF16 int4 GEMM (and its AMX-tile path, on a CPU with AMX) vs torch's
``_weight_int4pack_mm_for_cpu`` vs a dense bf16 ``F.linear``, on the embedded SmolLM2-135M's linear shapes, at
decode batch sizes, interleaved (best of N timing windows each).

    python -m benchmarks.int4_gemm                      # 2 threads, batches 1 4 8 16 31
    python -m benchmarks.int4_gemm --threads 1 --out benchmarks/results/int4_gemm_t1.json

Shapes (out x in, group 32, one plane): fused q/k/v 960 x 576, o 576 x 576, gate+up 3072 x 576, down
576 x 1536. Prints µs per call and GFLOP/s; the per-step line sums one layer's four GEMMs x 30 layers. Then
the LM head (49152 x 576) as 8-bit codes (``mm_u8``, the layout of the file's Q8_0 head) against dense bf16.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from radixrt.kernels import int4_gemm

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
LAYERS = 30


def _time_amx(rows: int, fn: Any, calls: int, windows: int) -> float:
    """`_time` with the int4 kernel's AMX row threshold at ``rows`` (0: the AVX512-BF16 path), set once
    before the timing windows."""
    torch.ops.radixrt_int4.amx_rows(rows)
    return _time(fn, calls, windows)


def _time(fn: Any, calls: int, windows: int) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,4,8,16,31")
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    reason = int4_gemm.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"radixrt's int4 kernel cannot run here: {reason}")
    amx = int(torch.ops.radixrt_int4.amx_rows(-1)) >= 0
    kernels = ["radixrt int4", *(["radixrt int4 amx"] if amx else []), "torch int4", "dense bf16"]
    rows: list[dict[str, Any]] = []
    for name, (n, k) in SHAPES.items():
        g = torch.Generator().manual_seed(n + k)
        codes = torch.randint(0, 16, (1, n, k), generator=g, dtype=torch.uint8)
        scales = torch.rand(1, n, k // 32, generator=g) * 0.02
        zeros = torch.randn(1, n, k // 32, generator=g) * 0.01
        ours = int4_gemm.pack(codes, scales, zeros, 32)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes[0].int(), 2)
        sz = torch.stack([scales[0], zeros[0]], -1).transpose(0, 1).bfloat16().contiguous()
        dense = torch.randn(n, k, generator=g).bfloat16()
        for m in map(int, ns.batches.split(",")):
            x = torch.randn(m, k, generator=g).bfloat16()
            t = {
                "radixrt int4": _time_amx(
                    0, lambda x=x, w=ours: int4_gemm.int4_mm(x, w), ns.calls, ns.windows
                ),
                **(
                    {
                        "radixrt int4 amx": _time_amx(
                            1, lambda x=x, w=ours: int4_gemm.int4_mm(x, w), ns.calls, ns.windows
                        )
                    }
                    if amx
                    else {}
                ),
                "torch int4": _time(
                    lambda x=x, p=packed, sz=sz: torch._weight_int4pack_mm_for_cpu(x, p, 32, sz),
                    ns.calls,
                    ns.windows,
                ),
                "dense bf16": _time(lambda x=x, w=dense: F.linear(x, w), ns.calls, ns.windows),
            }
            row = {"shape": name, "n": n, "k": k, "m": m, **{f"{key} us": v * 1e6 for key, v in t.items()}}
            rows.append(row)
            gf = {key: 2 * m * n * k / v / 1e9 for key, v in t.items()}
            print(f"{name:>8} {n}x{k} M={m:<3} " + "  ".join(f"{key} {t[key] * 1e6:7.1f} us {gf[key]:6.0f} GF/s" for key in t), flush=True)  # fmt: skip
    print(f"\none decode step's GEMMs ({LAYERS} layers, LM head excluded), ms, {ns.threads} thread(s):")
    for m in map(int, ns.batches.split(",")):
        per = {key: LAYERS * sum(r[f"{key} us"] for r in rows if r["m"] == m) / 1e3 for key in kernels}
        print(f"  M={m:<3} " + "  ".join(f"{key} {v:6.2f}" for key, v in per.items())
              + f"  (torch / radixrt {per['torch int4'] / per['radixrt int4']:.2f}x)")  # fmt: skip
    head = _head(ns, amx)
    if amx:
        torch.ops.radixrt_int4.amx_rows(int4_gemm.AMX_MIN_ROWS_DEFAULT)
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(
            json.dumps({"threads": ns.threads, "amx": amx, "rows": rows, "head": head}, indent=1)
        )
        print(f"wrote {ns.out}")


def _head(ns: argparse.Namespace, amx: bool) -> list[dict[str, Any]]:
    """The LM head as 8-bit codes (``mm_u8``) vs dense bf16, ms per call."""
    n, k = HEAD
    g = torch.Generator().manual_seed(n)
    u = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    w8 = int4_gemm.pack_u8(
        u, torch.rand(n, k // 32, generator=g) * 0.01, torch.randn(n, k // 32, generator=g), 32
    )
    dense = torch.randn(n, k, generator=g).bfloat16()
    out: list[dict[str, Any]] = []
    print(f"\nLM head {n}x{k}, ms per call:")
    for m in map(int, ns.batches.split(",")):
        x = torch.randn(m, k, generator=g).bfloat16()
        calls = max(ns.calls // 10, 5)
        t = {"radixrt u8": _time_amx(0, lambda x=x: int4_gemm.u8_mm(x, w8), calls, ns.windows)}
        if amx:
            t["radixrt u8 amx"] = _time_amx(1, lambda x=x: int4_gemm.u8_mm(x, w8), calls, ns.windows)
        t["dense bf16"] = _time(lambda x=x: F.linear(x, dense), calls, ns.windows)
        out.append({"m": m, **{f"{key} ms": v * 1e3 for key, v in t.items()}})
        print(f"  M={m:<3} " + "  ".join(f"{key} {v * 1e3:6.2f}" for key, v in t.items()), flush=True)
    return out


if __name__ == "__main__":
    main()
