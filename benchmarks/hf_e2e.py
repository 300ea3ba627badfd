"""End to end against HF transformers' batched ``generate`` on a small fp32 Llama (issue 21's reference case).

    python -m benchmarks.hf_e2e                    # 40M fp32 Llama, 16 distinct prompts x 48 new tokens
    python -m benchmarks.hf_e2e --size 88m --batch 1 --repeats 5

Both generate greedily, exactly ``--new-tokens`` tokens for each of ``--batch`` distinct random prompts of
``--prompt-len`` tokens, in one call: ``Engine.generate`` with the whole batch (defaults: compiled decode and
extends, the radix cache flushed before each run) and HF ``model.generate`` with the batch as one tensor.
The clock covers the whole call (prefill included). Runs alternate (engine, HF, engine, HF, ...) in one
process with the same thread count; reported: each side's best and median seconds, the median of the
per-repeat ratios, and whether the greedy ids agree (fp32 on both sides: they should, token for token).
"""

from __future__ import annotations  # noqa: I001 - radixrt first (below)

import radixrt  # noqa: F401 - before torch: bounds libgomp's spin-waiting (radixrt/worker/threads.py)
import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, bench_checkpoint, format_table, machine_info, write_json


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="40m", help="a random_checkpoint size (40m, 88m, tiny)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="", help="suffix of the result file")
    ns = ap.parse_args(argv)
    torch.set_num_threads(ns.threads)
    from transformers import AutoModelForCausalLM

    from radixrt import Engine

    path = bench_checkpoint(ns.size)
    print("building the Engine (compiles decode buckets and extend graphs; cached after the first run) ...")
    eng = Engine(
        model_path=str(path), dtype="float32", max_total_tokens=4 * ns.batch * (ns.prompt_len + ns.new_tokens)
    )
    eng.worker.call(lambda s: torch.set_num_threads(ns.threads))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = sum(p.numel() for p in hf.parameters())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf.config.vocab_size - 64, (ns.batch, ns.prompt_len), generator=gen)
    prompts = ids.tolist()
    sampling = {"temperature": 0, "max_new_tokens": ns.new_tokens, "ignore_eos": True}
    pad = hf.generation_config.pad_token_id or 0

    def engine_run() -> list[list[int]]:
        eng.flush_cache()
        return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sampling)]

    @torch.inference_mode()
    def hf_run() -> list[list[int]]:
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=ns.new_tokens, min_new_tokens=ns.new_tokens, pad_token_id=pad)  # fmt: skip
        return out[:, ns.prompt_len :].tolist()  # type: ignore[no-any-return]

    engine_run(), hf_run()  # warm
    times: dict[str, list[float]] = {"engine": [], "hf": []}
    outs: dict[str, list[list[int]]] = {}
    for rep in range(ns.repeats):
        for name, fn in (("engine", engine_run), ("hf", hf_run)):
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
        print(
            f"repeat {rep + 1}/{ns.repeats}: engine {times['engine'][-1]:.2f} s, HF {times['hf'][-1]:.2f} s",
            flush=True,
        )
    eng.shutdown()
    ratios = [h / e for e, h in zip(times["engine"], times["hf"], strict=True)]
    same = sum(a == b for a, b in zip(outs["engine"], outs["hf"], strict=True))
    result: dict[str, Any] = {
        "benchmark": "hf_e2e",
        "meta": machine_info(ns.threads),
        "config": {**vars(ns), "params": params},
        "seconds": times,
        "engine_speed_over_hf": {"median": statistics.median(ratios), "per_repeat": ratios},
        "same_greedy_ids": f"{same}/{ns.batch}",
    }
    write_json(RESULTS_DIR / f"hf_e2e{ns.tag}.json", result)
    tok = ns.batch * ns.new_tokens
    rows = [
        [name, f"{min(t):.2f}", f"{statistics.median(t):.2f}", f"{tok / min(t):.0f}"]
        for name, t in times.items()
    ]
    print(
        f"\n{params / 1e6:.0f}M fp32, {ns.batch} prompts x {ns.prompt_len} tokens, {ns.new_tokens} new, {ns.threads} threads"
    )
    print(format_table(["system", "best s", "median s", "tok/s (best)"], rows))
    print(f"Engine speed / HF generate: median {statistics.median(ratios):.2f}x "
          f"(per repeat {', '.join(f'{r:.2f}' for r in ratios)}); same greedy ids {same}/{ns.batch}")  # fmt: skip


if __name__ == "__main__":
    main()
