"""FP8 KV quality on the embedded real model (SmolLM2-135M-Instruct, bf16): fp8_e4m3 / fp8_e5m2 KV vs bf16 KV.

- greedy agreement over 128 tokens on held chat prompts (``benchmarks.model_quality.PROMPTS``), two ways:
  free-running (share of tokens before the first divergence from bf16 KV's continuation, the metric of
  ``model_quality.py``) and teacher-forced (the bf16-KV continuation is fed as the prompt; the share of
  its positions where the fp8 engine's argmax is the bf16 token), plus mean |delta logprob| there;
- perplexity on the ReAct traces' text (thoughts + observations, 512 tokens per text) and mean |delta
  logprob| per token;
- decode speed at each context of ``contexts`` and batch of ``batches`` (best of 3 interleaved rounds; a
  batch shares the context's prefix, cached, and differs in its last token): aggregate tok/s, the C decode
  kernel reading bf16 or the float8 codes in place.

Standalone: ``python -m benchmarks.kv_tiers_fp8 --data TRACES [--contexts 512,2048,8000] [--batches 1,8]``
prints the result as JSON (``--out`` writes it); ``benchmarks.kv_tiers --quality-only`` runs it into the
tier benchmark's results and docs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.model_quality import PROMPTS, agreement, react_texts
from benchmarks.react_traces import DATA_HELP, traces_file
from radixrt import Engine

NEW_TOKENS = 128
TEXT_TOKENS = 512
MODES = ("auto", "fp8_e4m3", "fp8_e5m2")
CONTEXTS = (512, 2048, 8000)  # SmolLM2 reads 8192 positions: 8000 + the decoded tokens fit
BATCHES = (1, 8)
DECODE_STEPS = 32
TARGET_AGREEMENT = 0.95
TARGET_PPL = 0.01
TARGET_SPEED = 0.9  # fp8 decode tok/s over bf16's, at context 2k


def _prompt_ids(eng: Engine, n: int) -> list[list[int]]:
    tok = eng.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS[:n]
    ]
    return [list(tok.encode(str(t), add_special_tokens=False)) for t in texts]


def _scored(eng: Engine, ids: list[list[int]], start: list[int]) -> list[dict[str, Any]]:
    """Prefill-only requests returning logprobs (and the top-1 token) of positions ``start[i]`` on."""
    return list(
        eng.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=start,
            top_logprobs_num=1,
        )
    )


def decode_speed(
    eng: Engine, ids: list[int], context: int, batch: int = 1, steps: int = DECODE_STEPS
) -> float:
    """Aggregate decode tok/s of ``batch`` requests at a ``context``-token prompt: ``ids[:context - 1]``
    (shared, cached by the warm-up) plus a last token of their own. The time of ``steps`` more tokens:
    a run of ``steps + 1`` tokens minus a run of 1 (both start from the cached prompt)."""
    assert len(ids) >= context + batch, (len(ids), context, batch)
    prompts = [ids[: context - 1] + [ids[context - 1 + i]] for i in range(batch)]
    params = {"temperature": 0, "ignore_eos": True}

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": n})
        return time.perf_counter() - t0

    timed(2)  # warm-up: the prompts enter the cache
    return batch * steps / max(timed(steps + 1) - timed(1), 1e-9)


def fp8_quality(
    data: Path,
    n_prompts: int,
    n_texts: int,
    contexts: tuple[int, ...] = CONTEXTS,
    batches: tuple[int, ...] = BATCHES,
    modes: tuple[str, ...] = MODES,
) -> dict[str, Any]:
    """The quality figures of every mode (``modes[0]`` is the reference, bf16 KV) and decode speeds."""
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    load = os.getloadavg()[0]
    rows: dict[str, dict[str, Any]] = {}
    ref_cont: list[list[int]] = []
    ref_text_lp: list[float] = []
    ref_cont_lp: list[float] = []
    texts = react_texts(data, n_texts)
    engines: dict[str, Engine] = {}  # kept until the end: decode speed is measured interleaved
    budget = max(8192, max(contexts, default=0) + 8 * max(batches, default=1) * (DECODE_STEPS + 2) + 1024)
    try:
        for mode in modes:
            eng = engines[mode] = Engine(kv_cache_dtype=mode, max_total_tokens=budget)
            prompts = _prompt_ids(eng, n_prompts)
            params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
            cont = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
            if mode == modes[0]:
                ref_cont = cont
            forced = _scored(
                eng, [p + c for p, c in zip(prompts, ref_cont, strict=True)], [len(p) for p in prompts]
            )
            top1 = [[e[0][1] for e in o["meta_info"]["input_top_logprobs"]] for o in forced]
            cont_lp = [e[0] for o in forced for e in o["meta_info"]["input_token_logprobs"]]
            text_ids = [eng.tokenizer.encode(t)[:TEXT_TOKENS] for t in texts]
            scored = _scored(eng, text_ids, [0] * len(text_ids))
            text_lp = [e[0] for o in scored for e in o["meta_info"]["input_token_logprobs"][1:]]
            pool = eng.worker.scheduler.runner.kv_pool
            row: dict[str, Any] = {
                "kv_dtype": str(pool.dtype).removeprefix("torch."),
                "kv_bytes_per_token": pool.size_bytes // pool.num_slots,
                "perplexity": math.exp(-statistics.fmean(text_lp)),
            }
            if mode == modes[0]:
                ref_text_lp, ref_cont_lp = text_lp, cont_lp
            share, same = agreement(ref_cont, cont)
            hits = [
                sum(a == b for a, b in zip(t, c, strict=True)) for t, c in zip(top1, ref_cont, strict=True)
            ]
            row.update(
                greedy_agreement=share,
                identical=f"{same}/{len(cont)}",
                teacher_forced_agreement=sum(hits) / sum(len(c) for c in ref_cont),
                chat_mean_abs_dlogprob=statistics.fmean(
                    abs(a - b) for a, b in zip(cont_lp, ref_cont_lp, strict=True)
                ),
                text_mean_abs_dlogprob=statistics.fmean(
                    abs(a - b) for a, b in zip(text_lp, ref_text_lp, strict=True)
                ),
            )
            rows[mode] = row
            print(f"fp8 quality {mode}: {row}", flush=True)
        ids = [t for ti in text_ids for t in ti]
        while len(ids) < max(contexts, default=0) + max(batches, default=1):
            ids += ids
        for c in contexts:
            for b in batches:
                key = f"b{b}_ctx{c}"
                best = dict.fromkeys(modes, 0.0)
                for _ in range(3):  # interleaved rounds, best of each: the machine's load drifts
                    for mode, eng in engines.items():
                        best[mode] = max(best[mode], decode_speed(eng, ids, c, b))
                for mode in modes:
                    rows[mode].setdefault("decode_tok_s", {})[key] = best[mode]
                    rows[mode].setdefault("decode_vs_bf16", {})[key] = best[mode] / best[modes[0]]
                print(
                    f"decode {key}: " + ", ".join(f"{m} {v:.1f} tok/s" for m, v in best.items()), flush=True
                )
    finally:
        for eng in engines.values():
            eng.shutdown()
    base = rows[modes[0]]["perplexity"]
    for row in rows.values():
        row["perplexity_vs_bf16"] = row["perplexity"] / base - 1
    targets: dict[str, Any] = {}
    for mode in modes[1:]:
        row = rows[mode]
        for metric in ("greedy_agreement", "teacher_forced_agreement"):
            targets[f"{mode}_{metric}"] = {"value": row[metric], "target": TARGET_AGREEMENT,
                                           "met": row[metric] >= TARGET_AGREEMENT}  # fmt: skip
        d = row["perplexity_vs_bf16"]
        targets[f"{mode}_perplexity_vs_bf16"] = {
            "value": d,
            "target": TARGET_PPL,
            "met": abs(d) <= TARGET_PPL,
        }
        speed = row.get("decode_vs_bf16", {}).get("b1_ctx2048")
        if speed is not None:
            targets[f"{mode}_decode_vs_bf16_b1_ctx2048"] = {
                "value": speed,
                "target": TARGET_SPEED,
                "met": speed >= TARGET_SPEED,
            }
    return {"model": "embedded SmolLM2-135M-Instruct (bf16)", "prompts": n_prompts, "new_tokens": NEW_TOKENS,
            "texts": n_texts, "text_tokens": TEXT_TOKENS, "decode_steps": DECODE_STEPS, "data": data.name, "date": started,
            "load_avg_at_start": load, "modes": rows, "targets": targets}  # fmt: skip


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=None, help=DATA_HELP)
    p.add_argument("--prompts", type=int, default=8, help="chat prompts x 128 greedy tokens")
    p.add_argument("--texts", type=int, default=16, help="ReAct texts (512 tokens each) for perplexity")
    p.add_argument("--contexts", type=_ints, default=CONTEXTS, help="decode speed contexts, e.g. 512,2048")
    p.add_argument("--batches", type=_ints, default=BATCHES, help="decode speed batch sizes, e.g. 1,8")
    p.add_argument("--modes", default=",".join(MODES), help="KV dtypes, the reference (bf16 KV: auto) first")
    p.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = p.parse_args()
    modes = tuple(args.modes.split(","))
    result = fp8_quality(traces_file(args.data), args.prompts, args.texts, args.contexts, args.batches, modes)
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
