"""Quality of each runtime mode against the fp32 reference on a real model, and its first-use cost.

``python -m benchmarks.model_quality [--readme]`` on the embedded SmolLM2-135M-Instruct (or
``--model-path``, e.g. ``gemma3-270m`` with ``--tag _gemma3_270m``): for every mode (fp32 = the reference,
bf16, ...)

- greedy agreement: 16 held chat prompts, 128 greedy tokens each; the share of tokens before the first
  divergence from fp32 and the number of identical sequences (a model without a chat template, such as
  Gemma 3 270M base, continues the bare prompts);
- perplexity on English: the thoughts and observations of the first ReAct traces in ``--data``
  (HotpotQA; without it synthetic traces, template English), scored as prompt logprobs (one
  prefill-only request per text, 512 tokens each);

and, once: the first-use GGUF conversion (fresh cache dir), the cache's size and the load time after it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, format_table, machine_info, update_readme_section, write_json
from benchmarks.react_traces import DATA_HELP, traces_file
from radixrt import Engine

PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning a new language.",
    "What is a radix tree used for?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I boil an egg?",
    "List the planets of the solar system in order.",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish and French.",
    "Why do cats purr?",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Suggest a name for a small bakery.",
    "How many legs does a spider have?",
    "Describe the water cycle briefly.",
]
MODES: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32", "quantization": "none"},  # the reference
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
    "int8 (bf16)": {"dtype": "bfloat16", "quantization": "int8"},
    "int4 (bf16)": {"dtype": "bfloat16", "quantization": "int4"},
    "gguf blocks (bf16)": {"dtype": "bfloat16", "quantization": "gguf"},
    "gguf + int8 dense GEMMs (bf16)": {"dtype": "bfloat16", "quantization": "gguf", "dense_gemm_int8": True},
}


def react_texts(path: Path, n: int) -> list[str]:
    """The first ``n`` traces' thoughts and observations as plain English text."""
    texts = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            for question, steps in json.loads(line).items():
                parts = [question] + [f"{s['thought']} {s['observation']}" for s in steps]
                texts.append("\n".join(parts))
            if len(texts) >= n:
                break
    return texts[:n]


def prompts_for(engine: Engine) -> list[str]:
    """The held prompts in the model's chat template, or bare when it has none (a base model)."""
    if getattr(engine.tokenizer, "chat_template", None) is None:
        return list(PROMPTS)
    return [
        str(
            engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
        )
        for q in PROMPTS
    ]


def greedy(engine: Engine, prompts: list[str], n: int) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    return [o["output_ids"] for o in engine.generate(prompt=prompts, sampling_params=params)]


def perplexity(engine: Engine, texts: list[str], tokens: int) -> float:
    total, count = 0.0, 0
    for text in texts:
        ids = engine.tokenizer.encode(text)[:tokens]
        out = engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
        )
        lps = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
        total, count = total - sum(lps), count + len(lps)
    return math.exp(total / count)


def hf_greedy(gguf_file: Path, prompts: list[list[int]], n: int, dtype: str) -> list[list[int]]:
    """HF transformers' greedy continuations on its own load of the GGUF file (one prompt at a time)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=getattr(torch, dtype)
    ).eval()
    outs = []
    with torch.inference_mode():
        for ids in tqdm(prompts, desc=f"HF {dtype}", leave=False):
            x = torch.tensor([ids])
            y = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids) :].tolist())
    return outs


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, int]:
    """(mean share of tokens before the first divergence, number of identical sequences)."""
    shares, same = [], 0
    for a, b in zip(ref, got, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        shares.append(k / len(a))
        same += k == len(a)
    return sum(shares) / len(shares), same


def first_use(model_path: str | None) -> dict[str, Any]:
    """Conversion in a fresh cache dir, then a second start from the cache (both in new processes)."""
    code = (
        "import time; t=time.perf_counter(); from radixrt.models.resolve import resolve_model; "
        f"r=resolve_model({model_path!r}); t1=time.perf_counter(); from radixrt import Engine; "
        f"e=Engine(model_path={model_path!r}, max_total_tokens=4096); t2=time.perf_counter(); "
        "print(t1-t, t2-t1, r.path); e.shutdown()"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "RADIXRT_CACHE_DIR": cache}
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            )
            wall = time.perf_counter() - t0
            resolve_s, load_s, path = out.stdout.split()[-3:]
            runs.append({"process_s": wall, "resolve_s": float(resolve_s), "engine_load_s": float(load_s)})
        size = sum(p.stat().st_size for p in Path(path).iterdir())
    return {"cold": runs[0], "warm": runs[1], "cache_mb": size / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-path", default=None, help="HF directory or .gguf (default: the embedded model)")
    p.add_argument("--data", type=Path, default=None, help=f"the perplexity texts. {DATA_HELP}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    p.add_argument("--skip-startup", action="store_true", help="skip the first-use conversion timing")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ppl-texts", type=int, default=16)
    p.add_argument("--ppl-tokens", type=int, default=512)
    p.add_argument("--hf", action="store_true", help="also HF transformers bf16 vs fp32 (the same measure)")
    p.add_argument("--readme", action="store_true", help="update docs/benchmarks.md")
    p.add_argument("--tag", default="", help="suffix of the result file and docs section (e.g. _gemma3_270m)")
    ns = p.parse_args()
    out_json = RESULTS_DIR / f"model_quality{ns.tag}.json"
    load0 = list(os.getloadavg())
    startup = None if ns.skip_startup else first_use(ns.model_path)
    texts = react_texts(traces_file(ns.data), ns.ppl_texts)
    results: dict[str, Any] = {}
    ref: list[list[int]] | None = None
    for mode in tqdm(ns.modes.split(","), desc="modes"):
        tqdm.write(f"{mode}: loading (load average {os.getloadavg()[0]:.1f})")
        with Engine(model_path=ns.model_path, max_total_tokens=16384, **MODES[mode]) as eng:
            chats = prompts_for(eng)
            ids = greedy(eng, chats, ns.new_tokens)
            ppl = perplexity(eng, texts, ns.ppl_tokens)
            prompt_ids = [eng.tokenizer.encode(c) for c in chats]
        ref = ref if ref is not None else ids
        share, same = agreement(ref, ids)
        results[mode] = {"agreement": share, "identical": same, "perplexity": ppl}
    if ns.hf:
        from radixrt.models.resolve import resolve_model

        gguf_file = resolve_model(ns.model_path).gguf_file
        assert gguf_file is not None, "--hf compares transformers' own load of a GGUF file"
        hf32 = hf_greedy(Path(gguf_file), prompt_ids, ns.new_tokens, "float32")
        assert ref is not None
        results["hf-fp32 (vs radixrt fp32)"] = dict(
            zip(("agreement", "identical"), agreement(ref, hf32), strict=True)
        )
        hf16 = hf_greedy(Path(gguf_file), prompt_ids, ns.new_tokens, "bfloat16")
        results["hf-bf16 (vs hf-fp32)"] = dict(
            zip(("agreement", "identical"), agreement(hf32, hf16), strict=True)
        )
    load1 = list(os.getloadavg())
    data = {"machine": machine_info(int(os.environ.get("OMP_NUM_THREADS", "0") or 0)), "startup": startup,
            "model_path": ns.model_path or "embedded", "prompts": len(PROMPTS), "new_tokens": ns.new_tokens,
            "ppl_texts": len(texts), "ppl_tokens": ns.ppl_tokens, "load_avg": [load0, load1],
            "modes": results}  # fmt: skip
    old = json.loads(out_json.read_text()) if out_json.is_file() else {}
    s = startup or old.get("startup")  # kept from the last run of this file (None when it has none)
    data["startup"] = s
    write_json(out_json, data)
    base = results[next(iter(results))]["perplexity"]
    rows = [[m, f"{r['agreement']:.3f}", f"{r['identical']}/{len(PROMPTS)}",
             f"{r['perplexity']:.3f}" if "perplexity" in r else "",
             f"{r['perplexity'] / base - 1:+.2%}" if "perplexity" in r else ""]
            for m, r in results.items()]  # fmt: skip
    table = format_table(["mode", "greedy agreement", "identical", "perplexity", "vs fp32"], rows)
    note = (
        ""
        if s is None
        else (
            f"First use (fresh cache dir, new process): GGUF -> HF conversion {s['cold']['resolve_s']:.1f} s, "
            f"cache {s['cache_mb']:.0f} MB; then Engine load {s['cold']['engine_load_s']:.1f} s. Later starts: "
            f"{s['warm']['resolve_s']:.2f} s to find the cache, Engine load {s['warm']['engine_load_s']:.1f} s, "
            f"{s['warm']['process_s']:.1f} s for the whole process (imports included)."
        )
    )
    where = (f"`--model-path {data['model_path']}`, {data['machine']['date']}, load average "
             f"{load0[0]:.1f} -> {load1[0]:.1f} (start -> end); perplexity over {len(texts)} texts x "
             f"{ns.ppl_tokens} tokens.")  # fmt: skip
    text = "\n\n".join(x for x in (where, table, note) if x)
    print(text)
    if ns.readme:
        update_readme_section(f"model_quality{ns.tag}", text)


if __name__ == "__main__":
    main()
