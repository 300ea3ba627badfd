"""Mixture-of-experts speed (issue 24): radixrt's compiled decode vs its eager decode vs HF transformers'
``generate`` on the same random-weight checkpoint, side by side in one process, fp32.

``python -m benchmarks.moe_speed [--readme] [--repeats 3] [--models mixtral,qwen3_moe]
[--systems compiled,eager,int8,hf]``. Two MoE models of a realistic small size, built once by
`radixrt.testing.random_checkpoint.make_checkpoint` and cached (see `MODELS`): a Mixtral-shaped one (hidden
768, 8 layers, 8 experts of width 1536, top 2; ~250M parameters) and a Qwen3-MoE-shaped one (hidden 512, 12
layers, 16 experts of width 768, top 2, per-head q/k norm; ~245M). Systems:

- ``radixrt compiled``: the Engine's defaults but fp32 (per-bucket compiled decode with the routed experts as
  an opaque op, buckets up to 16);
- ``radixrt eager``: the same with ``--disable-compile``;
- ``radixrt int8 compiled``: ``--quantization int8`` (experts, attention and LM head weight-only int8; the
  router float), fp32 activations;
- ``HF generate``: transformers' fp32 model, greedy ``generate`` with its own KV cache.

Figures, on fresh random prompts (``--new-tokens`` n decode steps): batch-1 decode and 16 streams decode
(aggregate) after 128-token prompts, decode only: radixrt prefills the prompts once (cached), then times
``1 + n`` new tokens minus 1 (each recomputing only the last prompt token); HF stamps every step of a ``1 +
n``-token ``generate`` from a logits processor and times the first to the last; prefill 512: one prompt and
1 new token through the Engine, one forward for HF. Each repeat measures every figure on every system before
the next figure (the order rotates per repeat, a pause between systems); the table gives the median (best)
over repeats and each radixrt system / HF (and / radixrt eager) ratio as the median of the per-repeat
ratios. Before timing, every system's greedy ids of one prompt are compared (the fp32 ones must agree;
int8 is only reported).
"""

from __future__ import annotations  # noqa: I001 - radixrt first (below)

import radixrt  # noqa: F401 - before torch: bounds libgomp's spin-waiting (radixrt/worker/threads.py)
import argparse
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, format_table, machine_info, update_readme_section, write_json
from benchmarks.cpu_peers import SETTLE_S, _busy_cpu_s
from radixrt.testing.random_checkpoint import CHECKPOINT_VERSION, cache_dir, make_checkpoint

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
                                num_key_value_heads=4, intermediate_size=1536, num_local_experts=8,
                                num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8,
                                    num_key_value_heads=4, moe_intermediate_size=768, num_experts=16,
                                    num_experts_per_tok=2)),
}  # fmt: skip
SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "compiled": ("radixrt compiled", {}),
    "eager": ("radixrt eager", {"disable_compile": True}),
    "int8": ("radixrt int8 compiled", {"quantization": "int8"}),
}
HF = "HF generate"
FIGURES = ("decode_b1", "b16_decode", "prefill512")
HEADERS = {"decode_b1": "batch-1 decode", "b16_decode": "16 streams decode", "prefill512": "prefill 512"}


def moe_checkpoint(label: str) -> Path:
    """The random-weight checkpoint of ``MODELS[label]``, built once (~10 s) and cached."""
    arch, overrides = MODELS[label]
    path = cache_dir() / "bench" / f"moe-{label}-{CHECKPOINT_VERSION}"
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        make_checkpoint(tmp, arch=arch, seed=24, **overrides)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


class RadixSide:
    """radixrt's in-process Engine on the checkpoint, fp32, in one mode (``flags``)."""

    def __init__(self, name: str, path: Path, **flags: Any) -> None:
        from radixrt import Engine

        self.name = name
        self.engine = Engine(model_path=str(path), dtype="float32", max_total_tokens=16 * 1024, **flags)

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        return [
            list(o["output_ids"]) for o in self.engine.generate(input_ids=prompts, sampling_params=params)
        ]

    def _timed(self, prompts: list[list[int]], n: int) -> float:
        t0 = time.perf_counter()
        self.generate(prompts, n)
        return time.perf_counter() - t0

    def decode_tok_s(self, prompts: list[list[int]], n: int) -> float:
        """The prompts are prefilled once and cached; then ``1 + n`` new tokens minus 1 new token (each
        recomputing only the prompt's last token) leaves n decode steps."""
        self.generate(prompts, 1)
        t1 = self._timed(prompts, 1)
        tn = self._timed(prompts, 1 + n)
        self.engine.flush_cache()
        return len(prompts) * n / (tn - t1)

    def prefill_tok_s(self, prompt: list[int]) -> float:
        dt = self._timed([prompt], 1)
        self.engine.flush_cache()
        return len(prompt) / dt

    def close(self) -> None:
        self.engine.shutdown()


class HFSide:
    """transformers' fp32 model of the checkpoint: greedy ``generate`` with its own KV cache (EOS ignored
    through ``min_new_tokens``; the prompts of one call have one length, so no padding)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.name = HF
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], n: int, stamps: list[float] | None = None
    ) -> list[list[int]]:
        from transformers import LogitsProcessorList

        def stamp(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if stamps is not None:
                stamps.append(time.perf_counter())
            return scores

        x = torch.tensor(prompts)
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0,
                                  logits_processor=LogitsProcessorList([stamp]))  # fmt: skip
        return [row[x.shape[1] :] for row in out.tolist()]

    def decode_tok_s(self, prompts: list[list[int]], n: int) -> float:
        """The logits processor stamps every step: from the first (after the prefill) to the last of
        ``1 + n`` steps, n decode forwards."""
        stamps: list[float] = []
        self.generate(prompts, 1 + n, stamps)
        return len(prompts) * n / (stamps[-1] - stamps[0])

    @torch.inference_mode()
    def prefill_tok_s(self, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        self.model(torch.tensor([prompt]))
        return len(prompt) / (time.perf_counter() - t0)

    def close(self) -> None:
        del self.model


Side = RadixSide | HFSide


def measure(side: Side, figure: str, rng: random.Random, vocab: int, n: int) -> float:
    """One value of ``figure`` (tok/s) on ``side`` with ``n`` decode steps, on fresh random prompts."""

    def fresh(batch: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]

    if figure == "decode_b1":
        return side.decode_tok_s(fresh(1, 128), n)
    if figure == "b16_decode":
        return side.decode_tok_s(fresh(16, 128), n)
    if figure == "prefill512":
        return side.prefill_tok_s(fresh(1, 512)[0])
    raise ValueError(f"unknown figure {figure!r}")


def run_model(label: str, ns: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    path = moe_checkpoint(label)
    peers: list[Side] = []
    startup: dict[str, float] = {}
    for key in ns.systems.split(","):
        t0 = time.perf_counter()
        if key == "hf":
            peers.append(HFSide(path))
        else:
            name, flags = SYSTEMS[key]
            peers.append(RadixSide(name, path, **flags))
        startup[peers[-1].name] = time.perf_counter() - t0
        log(f"{label}: {peers[-1].name} ready in {startup[peers[-1].name]:.0f} s")
    try:
        rng = random.Random(0)
        vocab = int(json.loads((path / "config.json").read_text(encoding="utf-8"))["vocab_size"])
        prompt = [rng.randrange(100, vocab - 100) for _ in range(40)]
        ids = {p.name: p.generate([prompt], 16)[0] for p in peers}
        exact = [p.name for p in peers if "int8" not in p.name]
        agree = len({tuple(ids[n]) for n in exact}) == 1
        log(f"{label}: greedy ids of the fp32 systems equal: {agree}")
        for p in tqdm(peers, desc=f"{label}: warm-up"):
            for fig in FIGURES:
                measure(p, fig, rng, vocab, 8)
        values: dict[str, dict[str, list[float]]] = {p.name: {f: [] for f in FIGURES} for p in peers}
        others: list[float | None] = []
        for rep in range(ns.repeats):
            order = peers[rep % len(peers) :] + peers[: rep % len(peers)]
            busy0, own0, t0 = _busy_cpu_s(), time.process_time(), time.perf_counter()
            for fig in FIGURES:
                for p in order:
                    time.sleep(SETTLE_S)
                    values[p.name][fig].append(measure(p, fig, rng, vocab, ns.new_tokens))
            busy1, own1, wall = _busy_cpu_s(), time.process_time(), time.perf_counter() - t0
            others.append(None if busy0 is None or busy1 is None
                          else max(0.0, busy1 - busy0 - (own1 - own0)) / wall)  # fmt: skip
            log(f"{label}: repeat {rep + 1}/{ns.repeats} (other processes: "
                f"{'?' if others[-1] is None else f'{others[-1]:.2f}'} cores): " + "; ".join(
                f"{p.name} " + " ".join(f"{values[p.name][f][-1]:.1f}" for f in FIGURES) for p in peers))  # fmt: skip
    finally:
        for p in peers:
            p.close()
    return {"checkpoint": MODELS[label], "params": num_params(path), "startup_s": startup, "greedy_ids": ids,
            "fp32_greedy_ids_equal": agree, "values": values, "other_cores": others,
            "summary": summarize(values)}  # fmt: skip


def num_params(path: Path) -> int:
    """Parameters in the checkpoint's safetensors files (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def summarize(values: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per system and figure: median and best; per radixrt system and figure: median of the per-repeat
    ratios to HF generate (and to radixrt eager)."""
    out: dict[str, Any] = {"systems": {}, "ratios": {}}
    for name, figs in values.items():
        out["systems"][name] = {f: {"median": statistics.median(v), "best": max(v)} for f, v in figs.items()}
    for base in (HF, SYSTEMS["eager"][0]):
        if base not in values:
            continue
        for name, figs in values.items():
            if name in (HF, base):
                continue
            out["ratios"][f"{name} / {base}"] = {
                f: statistics.median(a / b for a, b in zip(v, values[base][f], strict=True))
                for f, v in figs.items()
            }
    return out


def table(result: dict[str, Any]) -> str:
    s, ratios = result["summary"]["systems"], result["summary"]["ratios"]
    head = ["system", *[f"{HEADERS[f]} tok/s" for f in FIGURES]]
    rows = [
        [name, *[f"{v[f]['median']:,.1f} ({v[f]['best']:,.1f})" for f in FIGURES]] for name, v in s.items()
    ]
    rows += [[name, *[f"{r[f]:.2f}x" for f in FIGURES]] for name, r in ratios.items()]
    return format_table(head, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--systems", default="compiled,eager,int8,hf", help="compiled, eager, int8, hf")
    p.add_argument("--readme", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "moe_speed.json")
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)  # radixrt's worker threads (radixrt/worker/threads.py)
    info = machine_info(ns.threads) | {"gomp_spincount": os.environ.get("GOMP_SPINCOUNT")}
    results = {label: run_model(label, ns, tqdm.write) for label in ns.models.split(",")}
    info["load_avg_at_end"] = list(os.getloadavg())
    write_json(
        ns.out, {"machine": info, "new_tokens": ns.new_tokens, "repeats": ns.repeats, "results": results}
    )
    load = f"{info['load_avg_at_start'][0]:.1f} -> {info['load_avg_at_end'][0]:.1f}"
    spin = f"GOMP_SPINCOUNT={info['gomp_spincount']} " if info["gomp_spincount"] else ""
    parts = [
        f"`{spin}python -m benchmarks.moe_speed --readme`: fp32, {ns.threads} threads, {info['date']}, {ns.repeats} "
        f"interleaved repeats, {ns.new_tokens} decode tokens, load average {load} (start -> end). tok/s: "
        "median (best repeat); ratios: median of the per-repeat ratios."
    ]
    for label, r in results.items():
        arch, kw = r["checkpoint"]
        others = " / ".join("?" if c is None else f"{c:.2f}" for c in r["other_cores"])
        size = f", {r['params'] / 1e6:.0f}M parameters"
        parts.append(f"**{label}** (hidden {kw['hidden_size']}, {kw['num_hidden_layers']} layers, "
                     f"{kw.get('num_local_experts', kw.get('num_experts'))} experts of width "
                     f"{kw.get('moe_intermediate_size', kw.get('intermediate_size'))}, top "
                     f"{kw['num_experts_per_tok']}{size}; fp32 greedy ids equal: {r['fp32_greedy_ids_equal']}; "
                     f"other processes kept {others} cores busy per repeat)\n\n{table(r)}")  # fmt: skip
    text = "\n\n".join(parts)
    print(f"\n{text}\n")
    if ns.readme:
        update_readme_section("moe_speed", text)


if __name__ == "__main__":
    main()
