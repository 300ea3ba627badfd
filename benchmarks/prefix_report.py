"""Tables and the hit-rate plot of the prefix-cache benchmark (from its JSON results)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import format_table, update_readme_section


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def workload_table(result: dict[str, Any]) -> str:
    """One row per workload: its size and the exact optimum."""
    rows = []
    for name, w in result["workloads"].items():
        opt = w["optimum"]
        rows.append(
            [
                name,
                str(w["chains"]),
                str(w["calls"]),
                str(opt["prompt_tokens"]),
                str(opt["union_prompt_tokens"]),
                str(opt["decode_supplied"]),
                str(opt["optimal_computed"]),
                _pct(opt["optimal_hit_rate"]),
                str(w["working_set_tokens"]),
            ]
        )
    return format_table(
        [
            "workload",
            "chains",
            "calls",
            "prompt tok",
            "union trie",
            "decode-supplied",
            "optimal computed",
            "optimal hit rate",
            "working set",
        ],
        rows,
    )


def runs_table(result: dict[str, Any], kv_labels: tuple[str, ...] = ("ample", "25%")) -> str:
    """Cache off, then each policy at the given KV sizes: prefill vs optimum, hit rate, wall time."""
    rows = []
    for r in result["runs"]:
        if r["radix"] and r["kv_label"] not in kv_labels:
            continue
        rows.append(
            [
                r["workload"],
                "on" if r["radix"] else "off",
                r["policy"] if r["radix"] else "-",
                f"{r['kv_label']}: {r['kv_tokens']} ({r['kv_over_working_set']:.0%} ws)",
                str(r["computed_prefill_tokens"]),
                _ratio(r["computed_over_optimal"]),
                _pct(r["hit_rate"]),
                _ratio(r["hit_over_optimal"]),
                f"{r['wall_s']:.1f}",
                f"{r['speedup_vs_off']:.2f}x",
                str(r["evicted_tokens"]),
                str(r["retractions"]),
                "yes" if r["outputs_identical_to_off"] else "NO",
            ]
        )
    return format_table(
        [
            "workload",
            "radix",
            "policy",
            "KV pool tokens",
            "computed",
            "computed/opt",
            "hit rate",
            "hit/opt_hit",
            "wall s",
            "vs off",
            "evicted",
            "retract",
            "same ids",
        ],
        rows,
    )


def targets_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for name, t in result["targets"].items():
        status = "PASS" if t["pass"] else "FAIL"
        value = t["value"]
        shown = (
            ", ".join(f"{k} {v:.3f}" for k, v in value.items()) if isinstance(value, dict) else f"{value:.3f}"
        )
        note = f" ({t['note']})" if t.get("note") else ""
        lines.append(f"- {status} `{name}`: {shown}{note}")
    return lines


def print_summary(result: dict[str, Any]) -> None:
    print(workload_table(result))
    print()
    print(runs_table(result, kv_labels=tuple(sorted({r["kv_label"] for r in result["runs"]}))))
    if result.get("radix_micro"):
        m = result["radix_micro"]
        print(
            f"\nradix_micro: {m['key_len']}-token key vs a {m['tree_tokens']}-token tree: match "
            f"{m['match_ms_median']:.3f} ms, insert {m['insert_ms_median']:.3f} ms (medians)"
        )
    print("\n".join(targets_lines(result)))


def plot_hit_rate(by_size: dict[str, dict[str, Any]], path: Path) -> None:
    """Hit rate vs KV pool size (fraction of the working set), one line per policy; a panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(by_size)
    names = list(dict.fromkeys(w for s in sizes for w in by_size[s]["workloads"]))
    fig, axes = plt.subplots(
        len(sizes), len(names), figsize=(4.2 * len(names), 3.4 * len(sizes)), squeeze=False
    )
    for i, size in enumerate(sizes):
        res = by_size[size]
        for j, name in enumerate(names):
            ax = axes[i][j]
            if name not in res["workloads"]:
                ax.set_visible(False)
                continue
            ws = res["workloads"][name]["working_set_tokens"]
            runs = [r for r in res["runs"] if r["workload"] == name and r["radix"]]
            for pol in dict.fromkeys(r["policy"] for r in runs):
                pts = sorted((r["kv_tokens"] / ws, 100 * r["hit_rate"]) for r in runs if r["policy"] == pol)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=pol)
            ax.axhline(
                100 * res["workloads"][name]["optimum"]["optimal_hit_rate"],
                color="gray",
                linestyle="--",
                label="optimal",
            )
            ax.set_title(f"{name} ({size})")
            ax.set_xlabel("KV pool / working set")
            ax.set_ylabel("hit rate (%)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_readme(by_size: dict[str, dict[str, Any]]) -> None:
    """Rewrite the prefix-cache results section of benchmarks/README.md from the latest JSON."""
    parts = []
    for size, res in by_size.items():
        meta = res["meta"]
        parts.append(
            f"#### Model `{size}` — {meta['date'][:10]}, {meta['cpu_cores']} CPU cores, "
            f"{meta['torch_threads']} torch threads, load avg at start {meta['load_avg_at_start'][0]:.1f}"
        )
        parts.append(workload_table(res))
        parts.append(runs_table(res))
        if res.get("radix_micro"):
            m = res["radix_micro"]
            parts.append(
                f"`bench_match_insert`: {m['key_len']}-token key against a {m['tree_tokens']}-token "
                f"tree: match {m['match_ms_median']:.3f} ms, insert {m['insert_ms_median']:.3f} ms "
                f"(medians of {m['repeats']}; p90 {m['match_ms_p90']:.3f} / {m['insert_ms_p90']:.3f} ms)."
            )
        parts.append("\n".join(targets_lines(res)))
    update_readme_section("prefix_cache", "\n\n".join(parts))
