"""Constrained JSON decoding: jump-forward on vs off, and the cost of grammar masks per token.

    python -m benchmarks.json_decode [--size tiny|88m] [--requests 8] [--threads 2]

1. A schema with long fixed keys (where SGLang's compressed FSM shines): the same seeded requests
   one at a time with jump-forward off and on; decode steps (sampled tokens), tokens, wall time.
2. Mask overhead: batches of 1 and 32 constrained requests (jump-forward off) -> time spent filling
   and applying xgrammar bitmasks per constrained token, next to the decode time per token of an
   unconstrained run of the same shape.
Results: ``benchmarks/results/json_decode.json`` and a section of ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import (
    RESULTS_DIR,
    bench_checkpoint,
    format_table,
    machine_info,
    update_readme_section,
    write_json,
)
from radixrt import Engine

LONG_KEY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "the_full_legal_name_of_the_person_described": {"type": "string", "maxLength": 8},
        "the_age_of_the_person_in_whole_years": {"type": "integer", "minimum": 0, "maximum": 120},
        "the_primary_occupation_held_by_this_person": {"enum": ["engineer", "doctor", "teacher"]},
        "whether_the_person_currently_lives_abroad": {"type": "boolean"},
        "the_number_of_languages_this_person_speaks": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": [
        "the_full_legal_name_of_the_person_described",
        "the_age_of_the_person_in_whole_years",
        "the_primary_occupation_held_by_this_person",
        "whether_the_person_currently_lives_abroad",
        "the_number_of_languages_this_person_speaks",
    ],
}
PROMPT = "Describe a person as JSON: "


def _stats(eng: Engine) -> dict[str, float]:
    return eng.get_server_info()


def jump_forward_run(eng: Engine, jump: bool, n: int) -> dict[str, Any]:
    """Requests one at a time (batch 1): per-request wall time, tokens and sampled (decode) steps."""
    eng.worker.call(lambda s: setattr(s.args, "disable_jump_forward", not jump))
    params = {"json_schema": json.dumps(LONG_KEY_SCHEMA), "max_new_tokens": 256, "temperature": 1.0}
    eng.generate(prompt=PROMPT, sampling_params={**params, "seed": 10_000})  # compile + warm up
    before = _stats(eng)
    walls, tokens = [], []
    for i in tqdm(range(n), desc=f"jump-forward {'on' if jump else 'off'}"):
        t0 = time.perf_counter()
        out = eng.generate(prompt=PROMPT, sampling_params={**params, "seed": i})
        walls.append(time.perf_counter() - t0)
        tokens.append(out["meta_info"]["completion_tokens"])
        json.loads(out["text"], strict=False)  # xgrammar lets maxLength strings hold raw control chars
    after = _stats(eng)
    jumped = after["jump_forward_tokens"] - before["jump_forward_tokens"]
    return {
        "jump_forward": jump,
        "requests": n,
        "mean_wall_s": sum(walls) / n,
        "mean_tokens": sum(tokens) / n,
        "mean_decode_steps": (sum(tokens) - jumped) / n,
        "jump_forward_tokens_per_request": jumped / n,
        "tokens_per_s": sum(tokens) / sum(walls),
    }


def mask_overhead(eng: Engine, batch: int) -> dict[str, Any]:
    """Grammar mask time per constrained token vs decode time per token of a free run of equal shape."""
    eng.worker.call(lambda s: setattr(s.args, "disable_jump_forward", True))
    schema = json.dumps(LONG_KEY_SCHEMA)
    before = _stats(eng)
    t0 = time.perf_counter()
    outs = eng.generate(
        prompt=[PROMPT] * batch,
        sampling_params=[
            {"json_schema": schema, "max_new_tokens": 256, "temperature": 1.0, "seed": i}
            for i in range(batch)
        ],
    )
    constrained_wall = time.perf_counter() - t0
    after = _stats(eng)
    toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
    mean_tokens = max(1, round(toks / batch))
    t0 = time.perf_counter()
    eng.generate(
        prompt=[PROMPT] * batch,
        sampling_params={"max_new_tokens": mean_tokens, "ignore_eos": True, "temperature": 1.0, "seed": 1},
    )
    free_wall = time.perf_counter() - t0
    rows = after["grammar_masked_rows"] - before["grammar_masked_rows"]
    mask_s = after["grammar_mask_seconds"] - before["grammar_mask_seconds"]
    return {
        "batch": batch,
        "constrained_tokens": toks,
        "mask_us_per_token": 1e6 * mask_s / max(rows, 1),
        "constrained_wall_s": constrained_wall,
        "free_wall_s": free_wall,
        "free_us_per_token": 1e6 * free_wall / (mean_tokens * batch),
        "constrained_us_per_token": 1e6 * constrained_wall / max(toks, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=["tiny", "88m"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    path = bench_checkpoint(ns.size, arch="qwen2")
    eng = Engine(model_path=str(path), max_total_tokens=32768)
    try:
        off = jump_forward_run(eng, False, ns.requests)
        on = jump_forward_run(eng, True, ns.requests)
        masks = [mask_overhead(eng, b) for b in (1, 32)]
    finally:
        eng.shutdown()
    result = {
        "machine": machine_info(ns.threads),
        "size": ns.size,
        "jump_forward": [off, on],
        "masks": masks,
        "speedup_jump_forward": off["mean_wall_s"] / on["mean_wall_s"],
        "decode_step_reduction": off["mean_decode_steps"] / max(on["mean_decode_steps"], 1e-9),
    }
    write_json(RESULTS_DIR / "json_decode.json", result)
    rows = [
        [
            "off",
            f"{off['mean_decode_steps']:.1f}",
            f"{off['mean_tokens']:.1f}",
            f"{off['mean_wall_s'] * 1e3:.0f}",
        ],
        [
            "on",
            f"{on['mean_decode_steps']:.1f}",
            f"{on['mean_tokens']:.1f}",
            f"{on['mean_wall_s'] * 1e3:.0f}",
        ],
    ]
    table = format_table(["jump-forward", "decode steps/req", "tokens/req", "ms/req"], rows)
    mrows = [
        [
            str(m["batch"]),
            f"{m['mask_us_per_token']:.0f}",
            f"{m['free_us_per_token']:.0f}",
            f"{m['constrained_us_per_token']:.0f}",
        ]
        for m in masks
    ]
    mtable = format_table(["batch", "mask µs/token", "free decode µs/token", "constrained µs/token"], mrows)
    md = (
        f"### Constrained JSON decoding ({ns.size} Qwen2-arch model, {machine_info(ns.threads)['date'][:10]})\n\n"
        f"`python -m benchmarks.json_decode --size {ns.size}`: long-key schema, one request at a time.\n"
        f"Jump-forward: {result['speedup_jump_forward']:.2f}x faster per request, "
        f"{result['decode_step_reduction']:.2f}x fewer decode steps.\n\n{table}\n\n"
        f"Grammar mask cost (xgrammar bitmask fill + apply, jump-forward off):\n\n{mtable}\n"
    )
    update_readme_section("json_decode", md)
    print(md)


if __name__ == "__main__":
    main()
