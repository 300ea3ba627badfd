"""Tables and the plot of the KV-tier benchmark (from its JSON result)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import format_table, update_readme_section


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def tier_table(result: dict[str, Any]) -> str:
    rows = []
    for r in result["runs"]:
        w = result["workloads"][r["workload"]]
        p = r["prompt_tokens"]
        rows.append([
            r["workload"], r["config"], f"{r['kv_tokens']} ({w['device_over_ws']:.3f})",
            _pct(r["recompute_rate"]),
            f"{_pct(r['cached_tokens_device'] / p)} / {_pct(r['cached_tokens_host'] / p)} / "
            f"{_pct(r['cached_tokens_disk'] / p)}",
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}", f"{r['wall_s']:.1f}",
            "yes" if r["outputs_identical_to_none"] else "NO",
        ])  # fmt: skip
    head = ["workload", "tiers", "device pool (of WS)", "recompute", "hit device / host / disk",
            "TTFT p50 / p99 ms", "wall s", "outputs = none"]  # fmt: skip
    return format_table(head, rows)


def restart_table(result: dict[str, Any]) -> str:
    rows = []
    for r in result["restart"]:
        d, c = r["disk"], r["recompute"]
        rows.append([
            r["workload"], str(r["prompts"]), f"{_pct(d['computed_share_mean'])} / {_pct(d['computed_share_max'])}",
            f"{d['ttft_p50_ms']:.0f} / {d['ttft_p99_ms']:.0f}", f"{c['ttft_p50_ms']:.0f} / {c['ttft_p99_ms']:.0f}",
            f"{r['ttft_speedup_p50']:.1f}x",
        ])  # fmt: skip
    head = ["workload", "prompts", "computed mean / max", "TTFT disk p50 / p99 ms",
            "TTFT recompute p50 / p99 ms", "TTFT speed-up"]  # fmt: skip
    return format_table(head, rows)


def capacity_table(result: dict[str, Any]) -> str:
    cap = result["fp8_capacity"]
    rows = []
    for name in ("bf16", "fp8_e4m3"):
        r = cap[name]
        rows.append([name, str(r["kv_tokens"]), _pct(r["hit_rate"]), _pct(r["recompute_rate"]),
                     f"{r['ttft_p50_ms']:.0f}"])  # fmt: skip
    return format_table(["KV dtype", "tokens in the budget", "hit rate", "recompute", "TTFT p50 ms"], rows)


def quality_table(result: dict[str, Any]) -> str:
    q = result["fp8_quality"]
    rows = []
    for mode, r in q["modes"].items():
        rows.append([
            "bf16 (auto)" if mode == "auto" else mode, str(r["kv_bytes_per_token"]),
            f"{r['greedy_agreement']:.3f} ({r['identical']})", f"{r['teacher_forced_agreement']:.3f}",
            f"{r['chat_mean_abs_dlogprob']:.4f}", f"{r['perplexity']:.3f}", f"{100 * r['perplexity_vs_bf16']:+.2f}%",
            f"{r['text_mean_abs_dlogprob']:.4f}",
        ])  # fmt: skip
    head = ["KV", "bytes/token", "greedy agreement (identical)", "teacher-forced top-1", "chat mean abs dlogprob",
            "perplexity", "vs bf16", "text mean abs dlogprob"]  # fmt: skip
    return format_table(head, rows)


def speed_table(result: dict[str, Any]) -> str:
    """Decode tok/s per KV dtype at each (batch, context), with the ratio to bf16 KV."""
    modes = result["fp8_quality"]["modes"]
    keys = list(next(iter(modes.values())).get("decode_tok_s", {}))
    rows = []
    for key in keys:
        b, c = key.removeprefix("b").split("_ctx")
        cells = [f"{r['decode_tok_s'][key]:.1f} ({r['decode_vs_bf16'][key]:.2f}x)" for r in modes.values()]
        rows.append([b, c, *cells])
    head = ["batch", "context", *("bf16 (auto)" if m == "auto" else m for m in modes)]
    return format_table(head, rows)


def targets_table(result: dict[str, Any]) -> str:
    rows = [[k, f"{v['value']:.3f}", f"{v['target']:.3f}", "met" if v["met"] else "MISSED"]
            for k, v in result["targets"].items()]  # fmt: skip
    return format_table(["target", "measured", "bound", ""], rows)


def update_readme(result: dict[str, Any]) -> None:
    meta, cfg = result["meta"], result["config"]
    ws = ", ".join(
        f"{n}: {w['calls']} calls, working set {w['working_set_tokens']} tokens"
        for n, w in result["workloads"].items()
    )
    parts = [
        f"`python -m benchmarks.kv_tiers --readme` ({meta['date']}, {cfg['size']} model fp32, {ws}; "
        f"round-robin over conversations, {cfg['concurrency']} in flight; host tier = {cfg['host_ratio']:g}x the "
        f"device pool, host+disk = {cfg['disk_host_ratio']:g}x + disk; machine shared, load "
        f"{meta['load_avg_at_start'][0]:.1f} at start)",
        "",
        tier_table(result),
        "",
        "After a restart (new engine on the host+disk directory; every conversation's last prompt, one at a time):",
        "",
        restart_table(result),
    ]
    if "fp8_capacity" in result:
        cap = result["fp8_capacity"]
        parts += ["", f"FP8 capacity: chat, bf16 model, one KV budget of {cap['budget_bytes'] / 2**20:.1f} MiB "
                  f"({cap['budget_over_ws_bf16']:.2f} of the working set in bf16):", "", capacity_table(result)]  # fmt: skip
    if "fp8_quality" in result:
        q = result["fp8_quality"]
        when = f" ({q['date']}, load {q['load_avg_at_start']:.1f} at start)" if "date" in q else ""
        parts += ["", f"FP8 quality, {q['model']}: {q['prompts']} chat prompts x {q['new_tokens']} greedy tokens, "
                  f"perplexity on {q['texts']} ReAct texts x {q['text_tokens']} tokens; `python -m benchmarks.kv_tiers "
                  f"--quality-only --data {q.get('data', '...')} --readme`{when}:", "", quality_table(result), "",
                  "Greedy agreement is the share of tokens before the first divergence from bf16 KV (as in "
                  "`model_quality.py`, where bf16 vs fp32 *weights* score 0.202 on this model); teacher-forced: "
                  "bf16 KV's continuation as the prompt, the share of positions where the argmax is its token "
                  "(bf16 KV itself scores below 1: prefill and decode round differently).", "",
                  f"Decode tok/s (aggregate over the batch; {q.get('decode_steps', 32)} steps, best of 3 interleaved "
                  "rounds; a batch shares its cached context and differs in the last token), vs bf16 KV; the C "
                  "kernels read the float8 codes in place:", "", speed_table(result)]  # fmt: skip
    parts += ["", "Targets:", "", targets_table(result)]
    update_readme_section("kv_tiers", "\n".join(parts))


def print_summary(result: dict[str, Any]) -> None:
    print(tier_table(result))
    print(restart_table(result))
    if "fp8_capacity" in result:
        print(capacity_table(result))
    if "fp8_quality" in result:
        print(quality_table(result))
        if "decode_tok_s" in next(iter(result["fp8_quality"]["modes"].values())):
            print(speed_table(result))
    print(targets_table(result))


def plot(result: dict[str, Any], path: Path) -> None:
    """Recompute rate and TTFT p50 per configuration (a panel per workload), and the restart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(4.4 * (len(names) + 1), 3.6), squeeze=False)
    for j, name in enumerate(names):
        ax = axes[0][j]
        runs = [r for r in result["runs"] if r["workload"] == name]
        labels = [r["config"] for r in runs]
        ax.bar(
            labels,
            [100 * r["recompute_rate"] for r in runs],
            color=["#999", "#4c72b0", "#55a868"][: len(runs)],
        )
        ax.set_ylabel("prefill recompute (%)")
        ax2 = ax.twinx()
        ax2.plot(labels, [r["ttft_p50_ms"] for r in runs], "ko-", label="TTFT p50")
        ax2.set_ylabel("TTFT p50 (ms)")
        ax2.set_ylim(bottom=0)
        ax.set_title(f"{name}: device pool {result['workloads'][name]['device_over_ws']:.3f} of WS")
    ax = axes[0][-1]
    rs = result["restart"]
    x = range(len(rs))
    ax.bar([i - 0.2 for i in x], [r["recompute"]["ttft_p50_ms"] for r in rs], 0.4, label="recompute")
    ax.bar([i + 0.2 for i in x], [r["disk"]["ttft_p50_ms"] for r in rs], 0.4, label="from disk")
    ax.set_xticks(list(x), [r["workload"] for r in rs])
    ax.set_ylabel("TTFT p50 after restart (ms)")
    ax.set_title("restart")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
