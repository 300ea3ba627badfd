"""FP8 KV storage variants, simulated: what would a different float8 layout do to quality on the embedded model?

Each variant runs on a bf16-KV engine whose pool stores exactly what that variant's e4m3 pool would hand back
(quantize, then dequantize, with the scales a real ``--kv-cache-dtype fp8_e4m3`` engine calibrates), so layouts
the pool does not implement can be scored before building them. A variant is ``SCALES:CENTRE:SINKS``:

- ``SCALES``: ``head`` (one power-of-two scale per kv head, the pool's default) or ``channel`` (per key channel);
- ``CENTRE``: ``centred`` (keys minus the per-channel midpoint of their calibrated range, as the pool stores
  them) or ``raw``;
- ``SINKS``: the number of a sequence's first positions kept in bf16 (attention sinks; not implemented by the
  pool, see docs/cache.md "FP8 KV").

``real`` is the real fp8_e4m3 engine (C kernels reading float8). Metrics as in ``benchmarks.kv_tiers_fp8``:
teacher-forced top-1 agreement with bf16 KV's greedy continuation, free-running agreement, perplexity vs bf16 KV.

``python -m benchmarks.kv_fp8_variants --data TRACES [--variants real,head:centred:0,head:raw:4]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.kv_tiers_fp8 import NEW_TOKENS, TEXT_TOKENS, _prompt_ids, _scored
from benchmarks.model_quality import agreement, react_texts
from benchmarks.react_traces import DATA_HELP, traces_file
from radixrt import Engine
from radixrt.kernels.fp8 import dequantize_fp8, quantize_fp8

VARIANTS = "real,head:raw:0,channel:raw:0,head:centred:0,channel:centred:0,head:raw:4,head:centred:4"


def simulate(scheduler: Any, k_scale: torch.Tensor, v_scale: torch.Tensor, k_offset: torch.Tensor | None,
             sinks: int) -> None:  # fmt: skip
    """Make ``scheduler``'s bf16 pool store the e4m3 round trip of K/V, positions below ``sinks`` as they are."""
    runner = scheduler.runner
    pool, backend = runner.kv_pool, runner.backend
    keep: list[torch.Tensor | None] = [None]
    init, store = backend.init_forward_metadata, pool.set_kv

    def init_forward_metadata(md: Any) -> None:
        extend_lens = md.qo_indptr[1:] - md.qo_indptr[:-1]
        req = torch.repeat_interleave(torch.arange(md.batch_size), extend_lens)
        pos = md.prefix_lens[req] + torch.arange(int(md.qo_indptr[-1])) - md.qo_indptr[:-1][req]
        keep[0] = pos < sinks
        init(md)

    def set_kv(layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        off = 0.0 if k_offset is None else k_offset[layer]
        out = []
        for x, scale, shift in ((k, k_scale[layer], off), (v, v_scale[layer][:, None], 0.0)):
            y = (
                dequantize_fp8(quantize_fp8(x.float() - shift, torch.float8_e4m3fn, scale)) * scale + shift
            ).to(x.dtype)
            mask = keep[0]
            if mask is not None and mask.shape[0] == x.shape[0] and bool(mask.any()):
                y[mask] = x[mask]
            out.append(y)
        store(layer, loc, out[0], out[1])

    backend.init_forward_metadata = init_forward_metadata
    pool.set_kv = set_kv


def score(
    eng: Engine, prompts: list[list[int]], texts: list[list[int]], ref: dict[str, Any] | None
) -> dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    cont = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    ref_cont = ref["cont"] if ref else cont
    forced = _scored(eng, [p + c for p, c in zip(prompts, ref_cont, strict=True)], [len(p) for p in prompts])
    top1 = [[e[0][1] for e in o["meta_info"]["input_top_logprobs"]] for o in forced]
    scored = _scored(eng, texts, [0] * len(texts))
    lp = [e[0] for o in scored for e in o["meta_info"]["input_token_logprobs"][1:]]
    out: dict[str, Any] = {"cont": cont, "perplexity": math.exp(-statistics.fmean(lp))}
    if ref is not None:
        hits = sum(
            sum(a == b for a, b in zip(t, c, strict=True)) for t, c in zip(top1, ref_cont, strict=True)
        )
        out["teacher_forced_agreement"] = hits / sum(len(c) for c in ref_cont)
        out["greedy_agreement"] = agreement(ref_cont, cont)[0]
        out["perplexity_vs_bf16"] = out["perplexity"] / ref["perplexity"] - 1
    return out


def calibrated(per_channel: bool, centred: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(k_scale, v_scale, k_offset)`` of an fp8_e4m3 pool calibrated with these options (the pool's own
    calibration, run again on a fresh engine)."""

    def recalibrate(s: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        pool = s.runner.kv_pool
        pool.per_channel_k, pool.center_k = per_channel, centred
        s.runner._calibrate_kv_scales()
        assert pool.k_scale is not None and pool.v_scale is not None and pool.k_offset is not None
        return pool.k_scale.clone(), pool.v_scale.clone(), pool.k_offset.clone() if centred else None

    eng = Engine(kv_cache_dtype="fp8_e4m3", max_total_tokens=8192)
    try:
        return eng.worker.call(recalibrate)  # type: ignore[no-any-return]
    finally:
        eng.shutdown()


def run(data: Path, variants: list[str], n_prompts: int, n_texts: int) -> dict[str, Any]:
    """Score bf16 KV, then every variant against it."""
    bf16 = Engine(kv_cache_dtype="auto", max_total_tokens=8192)
    try:
        prompts = _prompt_ids(bf16, n_prompts)
        texts = [bf16.tokenizer.encode(t)[:TEXT_TOKENS] for t in react_texts(data, n_texts)]
        ref = score(bf16, prompts, texts, None)
    finally:
        bf16.shutdown()
    results: dict[str, Any] = {}
    for name in variants:
        if name == "real":
            eng = Engine(kv_cache_dtype="fp8_e4m3", max_total_tokens=8192)
        else:
            scales, centre, sinks = name.split(":")
            k_scale, v_scale, offset = calibrated(scales == "channel", centre == "centred")
            eng = Engine(kv_cache_dtype="auto", max_total_tokens=8192)
            eng.worker.call(lambda s: simulate(s, k_scale, v_scale, offset, int(sinks)))  # noqa: B023
        try:
            row = score(eng, prompts, texts, ref)
        finally:
            eng.shutdown()
        row.pop("cont")
        results[name] = row
        print(name, json.dumps(row), flush=True)
    return {"bf16_perplexity": ref["perplexity"], "variants": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=None, help=DATA_HELP)
    p.add_argument("--variants", default=VARIANTS, help="comma-separated, e.g. real,head:centred:4")
    p.add_argument("--prompts", type=int, default=8, help="chat prompts x 128 greedy tokens")
    p.add_argument("--texts", type=int, default=16, help="ReAct texts (512 tokens each) for perplexity")
    args = p.parse_args()
    print(
        json.dumps(run(traces_file(args.data), args.variants.split(","), args.prompts, args.texts), indent=1)
    )


if __name__ == "__main__":
    main()
