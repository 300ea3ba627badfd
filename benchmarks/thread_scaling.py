"""How radixrt's decode and prefill scale from 1 to 2 threads on this CPU (and llama.cpp's, side by side).

``python -m benchmarks.thread_scaling [--readme]``: the embedded SmolLM2 GGUF, radixrt ``--quantization
gguf`` (bf16) and llama.cpp on the same file; decode tok/s at batch 1 and 16 after a 128-token prompt,
prefill tok/s at 512 tokens, at 1 and 2 threads. The worker's threads come from ``OMP_NUM_THREADS``
(`radixrt/worker/threads.py`), set here before each engine starts.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, format_table, machine_info, update_readme_section, write_json
from benchmarks.cpu_systems import LlamaCppSystem, RadixSystem
from radixrt.models.embedded import embedded_gguf_path


def radix(threads: int, new_tokens: int) -> dict[str, float]:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    rs = RadixSystem(f"radixrt gguf, {threads} thread(s)", None, dtype="bfloat16", quantization="gguf")
    out = {"b1": rs.decode_tok_s(1, 128, new_tokens), "b16": rs.decode_tok_s(16, 128, new_tokens),
           "prefill512": rs.prefill_tok_s(512)}  # fmt: skip
    rs.close()
    return out


def llama_cpp(threads: int, new_tokens: int) -> dict[str, float]:
    lc = LlamaCppSystem(embedded_gguf_path(), threads)
    out = {
        "b1": lc.decode_tok_s(1, 128, new_tokens),
        "b16": float("nan"),
        "prefill512": lc.prefill_tok_s(512),
    }
    lc.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--readme", action="store_true")
    ns = p.parse_args()
    saved = os.environ.get("OMP_NUM_THREADS")
    results: dict[str, dict[str, Any]] = {}
    for threads in tqdm((1, 2), desc="threads"):
        results[f"radixrt gguf, {threads} thread"] = radix(threads, ns.new_tokens)
        results[f"llama.cpp, {threads} thread"] = llama_cpp(threads, ns.new_tokens)
    if saved is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    write_json(
        RESULTS_DIR / "thread_scaling.json",
        {"machine": machine_info(torch.get_num_threads()), "results": results},
    )
    rows = [[name, *(f"{r[k]:.0f}" if r[k] == r[k] else "" for k in ("b1", "b16", "prefill512"))]
            for name, r in results.items()]  # fmt: skip
    scale = []
    for system in ("radixrt gguf", "llama.cpp"):
        one, two = results[f"{system}, 1 thread"], results[f"{system}, 2 thread"]
        scale.append([f"{system}: 2 / 1 threads", *(f"{two[k] / one[k]:.2f}x" if one[k] == one[k] else ""
                                                    for k in ("b1", "b16", "prefill512"))])  # fmt: skip
    table = format_table(["", "decode b1 tok/s", "decode b16 tok/s", "prefill 512 tok/s"], rows + scale)
    print(table)
    if ns.readme:
        update_readme_section("thread_scaling", "SmolLM2-135M Q4_1, 1 vs 2 threads\n\n" + table)


if __name__ == "__main__":
    main()
