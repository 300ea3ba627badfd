"""CPU speed, side by side in one run: radixrt vs OpenVINO GenAI vs llama.cpp on the same GGUF file vs HF.

``python -m benchmarks.cpu_speed [--readme] [--threads 2]`` (OpenVINO GenAI and llama.cpp through
llama-cpp-python are benchmark-only dependencies, skipped with a message when missing: see
benchmarks/README.md). First the peer comparison on the embedded SmolLM2-135M-Instruct Q4_1 file
(`benchmarks.cpu_peers`: radixrt's defaults vs OpenVINO GenAI vs llama.cpp; batch-1 decode, 16 prompts x
128 tokens, prefill 512, extend 256 over a 3k cached prefix; ``--repeats`` interleaved repeats;
``--peers-only`` stops there; ``--model-path`` runs it on another GGUF file or embedded short name, e.g.
``--model-path gemma3-270m --tag _gemma3_270m``), then radixrt's modes on the embedded model and on the ~88M random Llama
written as a Q4_1 GGUF file:

- decode tok/s at batch 1, 8, 16, 32 after a 128-token prompt, per system;
- decode tok/s at context 512 / 2k / 8k, batch 1 and 8, for the fastest radixrt mode and llama.cpp;
- prefill tok/s at 512 and 2048 tokens (time to first token = 512 / that rate);
- radixrt Engine vs its own bare compiled forward loop at batch 16;
- a PNG of tok/s vs batch size, one line per system.
"""

from __future__ import annotations  # noqa: I001 - radixrt first (below)

import radixrt  # noqa: F401 - before torch: bounds libgomp's spin-waiting (radixrt/worker/threads.py)
import argparse
import json
import math
import os
from pathlib import Path
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
from benchmarks.cpu_peers import LLAMA_CPP_SETUP, build_peers, gguf_vocab_size, missing, run_peers
from benchmarks.cpu_peers import table as peers_table
from benchmarks.cpu_systems import HFSystem, LlamaCppSystem, RadixSystem, System
from radixrt.config.cache_dir import cache_dir

RADIX_MODES: dict[str, dict[str, Any]] = {
    "radixrt bf16 eager": {"dtype": "bfloat16", "quantization": "none", "disable_compile": True},
    "radixrt bf16": {"dtype": "bfloat16", "quantization": "none"},
    "radixrt int8": {"dtype": "bfloat16", "quantization": "int8"},
    "radixrt int4": {"dtype": "bfloat16", "quantization": "int4"},
    "radixrt gguf": {"dtype": "bfloat16", "quantization": "gguf"},
}
BEST = "radixrt gguf"  # the file's own Q4_1 blocks: what llama.cpp runs too
BATCHES = (1, 8, 16, 32)
SCHEMA = 2  # 2: + "peers" (the peer comparison, benchmarks/cpu_peers.py); "results" as in 1
LONG_B8_MAX = 2048


def gguf_of_88m() -> tuple[Path, Path]:
    """The ~88M random Llama checkpoint and its Q4_1 GGUF file (written once, cached)."""
    from radixrt.testing.gguf_writer import write_gguf

    ckpt = bench_checkpoint("88m", context=8448)
    out = cache_dir() / "bench" / "llama-88m-q4_1.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".tmp.gguf")
        write_gguf(ckpt, tmp, "Q4_1")
        tmp.replace(out)
    return ckpt, out


def measure(
    sys_: System, batches: tuple[int, ...], new_tokens: int, prefill: tuple[int, ...]
) -> dict[str, Any]:
    res: dict[str, Any] = {"decode": {}, "prefill": {}}
    for b in batches:
        res["decode"][str(b)] = sys_.decode_tok_s(b, 128, new_tokens)
    for n in prefill:
        res["prefill"][str(n)] = sys_.prefill_tok_s(n)
    return res


def long_context(
    sys_: System, contexts: tuple[int, ...], batches: tuple[int, ...], new_tokens: int
) -> dict[str, float]:
    """Batch 8 stops at 2k of context unless asked (8 x 8k prompts cost minutes of prefill per run)."""
    return {f"b{b}-ctx{c}": sys_.decode_tok_s(b, c, new_tokens) for b in batches for c in contexts
            if b == 1 or c <= LONG_B8_MAX}  # fmt: skip


def run_model(
    label: str, model_path: str | None, gguf_file: Path, hf_dir: Path, ns: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {"systems": {}, "long": {}, "startup_s": {}}
    prefill = (512, 2048)
    names = ns.modes.split(",") if label == "smollm2-135m" else ["radixrt bf16", BEST]
    modes = {k: RADIX_MODES[k] for k in names}
    for name, kw in tqdm(modes.items(), desc=f"{label}: radixrt modes"):
        rs = RadixSystem(name, model_path, **kw)
        out["startup_s"][name] = rs.startup_s
        out["systems"][name] = measure(rs, BATCHES, ns.new_tokens, prefill)
        if name == BEST:
            out["bare_loop_b16"] = rs.bare_loop_tok_s(16, 128, 20)
            if label == "smollm2-135m":
                out["long"][name] = long_context(rs, ns.contexts, (1, 8), ns.new_tokens)
        rs.close()
    why = missing("llama_cpp", LLAMA_CPP_SETUP)
    if why is None:
        lc = LlamaCppSystem(gguf_file, ns.threads)
        out["systems"]["llama.cpp"] = measure(lc, (1,), ns.new_tokens, prefill)
        if label == "smollm2-135m":
            out["long"]["llama.cpp"] = long_context(lc, ns.contexts, (1,), ns.new_tokens)
        lc.close()
    else:
        tqdm.write(f"{label}: llama.cpp skipped: {why}")
        out["skipped"] = {"llama.cpp": why}
    if not ns.skip_hf:
        for name, dtype, batches in (("HF bf16", torch.bfloat16, (1, 8)), ("HF fp32", torch.float32, (1,))):
            hf = HFSystem(name, hf_dir, gguf_file if label == "smollm2-135m" else None, dtype)
            out["systems"][name] = measure(hf, batches, min(ns.new_tokens, 16), (512,))
            hf.close()
    return out


def fmt(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.0f}"


def tables(results: dict[str, Any]) -> str:
    parts = []
    for label, r in results.items():
        rows = []
        for name, s in r["systems"].items():
            rows.append([name] + [fmt(s["decode"].get(str(b))) for b in BATCHES]
                        + [fmt(s["prefill"].get("512")), fmt(s["prefill"].get("2048"))])  # fmt: skip
        head = ["system"] + [f"decode b{b}" for b in BATCHES] + ["prefill 512", "prefill 2048"]
        parts.append(f"**{label}** (tok/s)\n\n" + format_table(head, rows))
        if r["long"]:
            keys = sorted(
                {k for v in r["long"].values() for k in v},
                key=lambda k: (int(k.split("-")[0][1:]), int(k.split("ctx")[1])),
            )
            rows = [[n] + [fmt(v.get(k)) for k in keys] for n, v in r["long"].items()]
            parts.append("decode tok/s by batch and context\n\n" + format_table(["system", *keys], rows))
    return "\n\n".join(parts)


def targets(results: dict[str, Any]) -> str:
    r = results["smollm2-135m"]
    s = r["systems"]
    best = s[BEST]
    lines = []
    lc = s.get("llama.cpp")
    if lc is None:
        lines.append("- vs llama.cpp: not measured (llama.cpp skipped)")
    else:
        lines += [
            f"- batch-1 decode vs llama.cpp: {best['decode']['1'] / lc['decode']['1']:.2f}x (target >= 1.0)",
            f"- batch-16 aggregate decode vs llama.cpp single stream: {best['decode']['16'] / lc['decode']['1']:.2f}x (target >= 4)",
            f"- prefill 512 vs llama.cpp: {best['prefill']['512'] / lc['prefill']['512']:.2f}x (target >= 1.5)",
        ]
    lines += [
        f"- Engine vs its bare compiled forward loop, batch 16: {best['decode']['16'] / r['bare_loop_b16']:.2f}x (target >= 0.9)",
        f"- compiled vs eager (bf16, batch 1): {s['radixrt bf16']['decode']['1'] / s['radixrt bf16 eager']['decode']['1']:.2f}x",
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2))
    for ax, (label, r) in zip(axes if len(results) > 1 else [axes], results.items(), strict=True):
        for name, s in r["systems"].items():
            pts = [(int(b), v) for b, v in s["decode"].items() if not math.isnan(v)]
            if len(pts) == 1:
                ax.axhline(pts[0][1], ls="--", lw=1, label=f"{name} (one sequence)")
            else:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.set(
            xscale="log", yscale="log", xlabel="batch size", ylabel="decode tok/s (aggregate)", title=label
        )
        ax.set_xticks(list(BATCHES), [str(b) for b in BATCHES])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def peer_gguf(model_path: str | None) -> Path:
    """The GGUF file of ``--model-path`` (converted for radixrt up front, with progress)."""
    from radixrt.models.embedded import embedded_gguf_path
    from radixrt.models.resolve import resolve_model

    if model_path is None:
        return embedded_gguf_path()
    gguf_file = resolve_model(model_path).gguf_file
    if gguf_file is None:
        raise SystemExit(f"--model-path {model_path}: not a GGUF file; the peers run the same GGUF file")
    return Path(gguf_file)


def peer_comparison(ns: argparse.Namespace, gguf: Path) -> dict[str, Any]:
    """The peer comparison (`benchmarks.cpu_peers`) on ``gguf``, its table printed and (``--readme``)
    written to the ``cpu_speed_peers`` section; the JSON block the results file keeps under ``peers``."""
    info = machine_info(ns.threads)
    peers, started = build_peers(gguf, ns.threads, ns.peers.split(","), log=tqdm.write)
    try:
        result = run_peers(peers, gguf_vocab_size(gguf), ns.repeats, log=tqdm.write)
    finally:
        for p in peers:
            p.close()
    info["load_avg_at_end"] = list(os.getloadavg())
    block = {"machine": info, "gguf": gguf.name, "threads": ns.threads, **started, **result}
    text = peers_table(result)
    load = f"{info['load_avg_at_start'][0]:.1f} -> {info['load_avg_at_end'][0]:.1f}"
    vers = ", ".join(f"{name} {v}" for name, v in started["versions"].items())
    others = " / ".join("?" if c is None else f"{c:.2f}" for c in result["other_cores"])
    skipped = "".join(f"\n- {name}: skipped: {why}" for name, why in started["skipped"].items())
    note = (f"`python -m benchmarks.cpu_speed --peers-only`: {gguf.name}, {ns.threads} threads each, "
            f"{info['date']}, {ns.repeats} interleaved repeats, load average {load} (start -> end), other "
            f"processes kept {others} cores busy per repeat; versions: {vers}. tok/s: "
            f"median (best repeat); ratios: median of the per-repeat radixrt / peer ratios.")  # fmt: skip
    print(f"\n{text}{skipped}\n")
    if ns.readme:
        update_readme_section(f"cpu_speed_peers{ns.tag}", f"{note}\n\n{text}{skipped}")
    return block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--contexts", type=lambda s: tuple(int(x) for x in s.split(",")), default=(512, 2048, 8000)
    )
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--models", default="smollm2-135m,88m")
    p.add_argument("--readme", action="store_true")
    p.add_argument("--tag", default="", help="suffix of the result files and README section (e.g. _1thread)")
    p.add_argument("--modes", default=",".join(RADIX_MODES), help="radixrt modes for the embedded model")
    p.add_argument("--long-b8-max", type=int, default=LONG_B8_MAX, help="longest context measured at batch 8")
    p.add_argument(
        "--peers",
        default="radixrt,openvino,openvino-llm,llama.cpp",
        help="systems of the peer comparison (radixrt, radixrt-int8, radixrt-torch, openvino, openvino-llm, llama.cpp)",
    )
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats of the peer comparison")
    p.add_argument(
        "--peers-only", action="store_true", help="only the peer comparison (keeps the rest of the JSON)"
    )
    p.add_argument("--skip-peers", action="store_true", help="no peer comparison")
    p.add_argument(
        "--model-path",
        default=None,
        help="the peer comparison's GGUF file or embedded short name (default: the embedded SmolLM2 file)",
    )
    ns = p.parse_args()
    globals()["LONG_B8_MAX"] = ns.long_b8_max
    torch.set_num_threads(ns.threads)
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)  # radixrt's worker threads (radixrt/worker/threads.py)
    from radixrt.models.embedded import embedded_gguf_path
    from radixrt.models.resolve import resolve_model

    out_json = RESULTS_DIR / f"cpu_speed{ns.tag}.json"
    peers = None if ns.skip_peers else peer_comparison(ns, peer_gguf(ns.model_path))
    if ns.peers_only:
        assert peers is not None
        old = json.loads(out_json.read_text(encoding="utf-8")) if out_json.is_file() else {}
        write_json(out_json, old | {"schema": SCHEMA, "peers": peers})
        return
    results: dict[str, Any] = {}
    for label in ns.models.split(","):
        if label == "smollm2-135m":
            g = embedded_gguf_path()
            results[label] = run_model(label, None, g, Path(resolve_model(None).path), ns)
        else:
            ckpt, g = gguf_of_88m()
            results[label] = run_model(label, str(g), g, ckpt, ns)
    data = {
        "schema": SCHEMA,
        "machine": machine_info(ns.threads),
        "new_tokens": ns.new_tokens,
        "results": results,
    }
    if peers is not None:
        data["peers"] = peers
    write_json(out_json, data)
    plot(results, RESULTS_DIR / f"cpu_speed{ns.tag}.png")
    full = "smollm2-135m" in results and set(RADIX_MODES) <= set(results["smollm2-135m"]["systems"])
    text = tables(results) + ("\n\n" + targets(results) if full else "")
    print(text)
    if ns.readme:
        update_readme_section(
            f"cpu_speed{ns.tag}", text + f"\n\n![decode tok/s vs batch](results/cpu_speed{ns.tag}.png)"
        )


if __name__ == "__main__":
    main()
