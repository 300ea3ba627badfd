"""FP8 KV quality on a second prompt set (issue 26 item 5's re-check), beside the first one's method.

``benchmarks.kv_tiers_fp8`` measures fp8 KV against bf16 KV on the project's own set: 8 short chat questions
(``benchmarks.model_quality.PROMPTS``) for agreement, the HotpotQA traces' thoughts and observations for
perplexity. This measures the same figures on different English text used a different way:

- ``hotpot_chat``: chat prompts that hand the model a HotpotQA passage (the first observation of a trace,
  real Wikipedia text) and its question, 128 greedy tokens each from bf16 KV; teacher-forced top-1 agreement
  (the bf16-KV continuation fed as the prompt: the share of its positions where the fp8 engine's argmax is
  the bf16 token) and free-running greedy agreement. Needs ``--data`` (the traces file); skipped without it.
- ``package_prose``: the English prose of installed packages' long descriptions (their ``METADATA``:
  code blocks, tables, markup and short lines dropped), 512 tokens per package; perplexity, and top-1
  agreement at every position (the fp8 engine's argmax against the bf16 engine's argmax on the same text).

``python -m benchmarks.kv_fp8_second_set [--data TRACES] [--prompts 8] [--texts 16] [--modes auto,fp8_e4m3]``
prints the result and writes ``benchmarks/results/kv_fp8_second_set.json`` (``--out``). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, machine_info, write_json
from benchmarks.kv_tiers_fp8 import NEW_TOKENS, TARGET_AGREEMENT, TARGET_PPL, TEXT_TOKENS, _scored
from benchmarks.model_quality import agreement
from benchmarks.react_traces import DATA_HELP
from radixrt import Engine

# Installed with the project (pyproject's dependencies and dev extras): prose-heavy long descriptions.
PACKAGES = (
    "tqdm", "openai", "fastapi", "pydantic", "transformers", "torch", "httpx", "regex", "orjson", "loguru",
    "psutil", "jedi", "datasets", "sentencepiece", "charset_normalizer", "matplotlib", "hypothesis",
    "uvicorn", "msgspec", "prometheus_client", "pyzmq", "xgrammar", "numpy", "safetensors",
)  # fmt: skip
PASSAGE_CHARS = 1200  # of a HotpotQA observation: a prompt of ~300 tokens
TRACES_SKIPPED = 50  # the first set's perplexity reads the first traces: start past them
_MARKUP = re.compile(r"`[^`]*`|\[([^\]]*)\]\([^)]*\)|<[^>]+>|\*\*|__|[#*]")


def prose(text: str) -> str:
    """The sentences of a package description: fenced code, tables, indented code, headings and lines
    of fewer than 6 words or mostly non-letters dropped; inline markup stripped."""
    out: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced or line.startswith(("    ", "\t", "|", ">>>", "..", "#", "=", "-" * 3)):
            continue
        line = _MARKUP.sub(lambda m: m.group(1) or "", line).strip()
        letters = sum(c.isalpha() or c == " " for c in line)
        if len(line.split()) >= 6 and letters >= 0.85 * len(line):
            out.append(line)
    return " ".join(out)


def package_texts(n: int, tokenizer: Any) -> list[tuple[str, list[int]]]:
    """Up to ``n`` (package, first TEXT_TOKENS token ids of its prose), packages with less prose skipped."""
    texts: list[tuple[str, list[int]]] = []
    for name in PACKAGES:
        try:
            body = metadata.metadata(name).get_payload()  # type: ignore[attr-defined]
        except metadata.PackageNotFoundError:
            continue
        ids = list(tokenizer.encode(prose(str(body or "")), add_special_tokens=False))
        if len(ids) >= TEXT_TOKENS:
            texts.append((name, ids[:TEXT_TOKENS]))
        if len(texts) == n:
            break
    return texts


def hotpot_prompts(data: Path, n: int) -> list[str]:
    """``n`` user messages: a passage (the first long observation of a trace, from the TRACES_SKIPPED-th
    trace on) and the trace's question."""
    out: list[str] = []
    with data.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < TRACES_SKIPPED:
                continue
            for question, steps in json.loads(line).items():
                passage = next((s["observation"] for s in steps if len(s["observation"]) > 400), None)
                if passage is None:
                    continue
                q = question.removeprefix("Question:").strip()
                out.append(
                    f"Read this passage and answer the question.\n\n{passage[:PASSAGE_CHARS]}\n\nQuestion: {q}"
                )
            if len(out) >= n:
                return out[:n]
    return out


def _top1(rows: list[dict[str, Any]], skip: int = 0) -> list[list[int]]:
    """Each row's argmax token per scored position, from the ``skip``-th on (a text's first has none)."""
    return [[e[0][1] for e in o["meta_info"]["input_top_logprobs"][skip:]] for o in rows]


def measure(data: Path | None, n_prompts: int, n_texts: int, modes: tuple[str, ...]) -> dict[str, Any]:
    """Every mode against ``modes[0]`` (bf16 KV) on both sets."""
    res: dict[str, Any] = {"modes": {}}
    ref: dict[str, Any] = {}
    for mode in modes:
        eng = Engine(kv_cache_dtype=mode, max_total_tokens=16384)
        try:
            tok = eng.tokenizer
            row: dict[str, Any] = {}
            if data is not None:
                msgs = hotpot_prompts(data, n_prompts)
                chats = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                                 tokenize=False) for m in msgs]  # fmt: skip
                prompts = [list(tok.encode(str(c), add_special_tokens=False)) for c in chats]
                params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
                cont = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
                ref.setdefault("cont", cont)
                fed = [p + c for p, c in zip(prompts, ref["cont"], strict=True)]
                top1 = _top1(_scored(eng, fed, [len(p) for p in prompts]))
                hits = sum(
                    sum(a == b for a, b in zip(t, c, strict=True))
                    for t, c in zip(top1, ref["cont"], strict=True)
                )
                share, same = agreement(ref["cont"], cont)
                row["hotpot_chat"] = {
                    "prompts": len(prompts), "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
                    "teacher_forced_agreement": hits / sum(len(c) for c in ref["cont"]),
                    "greedy_agreement": share, "identical": f"{same}/{len(cont)}",
                }  # fmt: skip
            texts = package_texts(n_texts, eng.tokenizer)
            scored = _scored(eng, [ids for _, ids in texts], [0] * len(texts))
            lps = [e[0] for o in scored for e in o["meta_info"]["input_token_logprobs"][1:]]
            top = _top1(scored, skip=1)
            ref.setdefault("top", top)
            ref.setdefault("lps", lps)
            same_top = sum(
                sum(a == b for a, b in zip(t, r, strict=True)) for t, r in zip(top, ref["top"], strict=True)
            )
            row["package_prose"] = {
                "packages": [name for name, _ in texts], "tokens": len(lps),
                "perplexity": math.exp(-statistics.fmean(lps)),
                "top1_agreement_vs_bf16": same_top / sum(len(t) for t in top),
                "mean_abs_dlogprob": statistics.fmean(abs(a - b) for a, b in zip(lps, ref["lps"], strict=True)),
            }  # fmt: skip
        finally:
            eng.shutdown()
        res["modes"][mode] = row
        print(f"{mode}: {json.dumps(row)}", flush=True)
    base = res["modes"][modes[0]]["package_prose"]["perplexity"]
    for mode in modes:
        prose_row = res["modes"][mode]["package_prose"]
        prose_row["perplexity_vs_bf16"] = prose_row["perplexity"] / base - 1
    res["targets"] = {"teacher_forced_agreement": TARGET_AGREEMENT, "perplexity_vs_bf16": TARGET_PPL}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kv_fp8_second_set", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--data", type=Path, default=None, help=DATA_HELP + " (the hotpot_chat set; skipped without)"
    )
    p.add_argument("--prompts", type=int, default=8, help="HotpotQA chat prompts x 128 greedy tokens")
    p.add_argument("--texts", type=int, default=16, help="package descriptions (512 tokens each)")
    p.add_argument("--modes", default="auto,fp8_e4m3", help="KV dtypes, the reference (bf16 KV: auto) first")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "kv_fp8_second_set.json")
    ns = p.parse_args(argv)
    if ns.data is not None and not ns.data.is_file():
        p.error(f"--data {ns.data}: no such file")
    load = os.getloadavg()
    result = {"machine": machine_info(os.cpu_count() or 1), "data": None if ns.data is None else ns.data.name,
              **measure(ns.data, ns.prompts, ns.texts, tuple(ns.modes.split(","))),
              "load_avg_start_end": [load[0], os.getloadavg()[0]]}  # fmt: skip
    write_json(ns.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
