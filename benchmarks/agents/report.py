"""Tables, targets and plots from the runs of one suite invocation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import format_table

HEADLINE = (
    "radixrt",
    "radixrt-engine",
    "openvino",
    "llama.cpp",
    "hf",
    "radix-off",
    "radixrt-fcfs",
    "radixrt-mixed",
    "radixrt-ngram",
    "radixrt-suffix",
    "radixrt-kv8",
    "radixrt-q8",
    "url",
)
COLORS = dict(zip(HEADLINE, ("tab:blue", "tab:orange", "tab:olive", "tab:green", "tab:red", "tab:purple", "tab:brown",
                             "tab:pink", "tab:cyan", "black", "gold", "darkgreen", "tab:gray"), strict=True))  # fmt: skip
PEERS = ("openvino", "llama.cpp", "hf", "radix-off")  # radixrt / each of these in the headline table


def _find(
    runs: list[dict[str, Any]], workload: str, backend: str, parallel: int | None
) -> dict[str, Any] | None:
    """The run of ``backend`` on ``workload`` at ``parallel`` (a sequential backend: its only run)."""
    cands = [r for r in runs if r["workload"] == workload and r["backend"] == backend]
    exact = [r for r in cands if r["parallel"] == parallel]
    found = exact or (cands if backend == "hf" else [])
    return found[0] if found else None


def _num(value: Any, fmt: str = ".3f") -> str:
    return "" if value is None else format(value, fmt)


def _cell(run: dict[str, Any] | None, key: str, fmt: str = ".3f") -> str:
    if run is None:
        return ""
    if run["status"] == "n/a":
        return "n/a"
    if run["status"] != "ok":
        return "error"
    return _num(run.get(key), fmt)


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str = "programs_per_s") -> float | None:
    if not a or not b or a["status"] != "ok" or b["status"] != "ok" or not a.get(key) or not b.get(key):
        return None
    return float(a[key]) / float(b[key])


def workload_names(runs: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["workload"] for r in runs))


def headline_table(runs: list[dict[str, Any]], parallel: int) -> str:
    """Per workload: programs/s of each system at ``parallel`` and radixrt's ratios to the others."""
    backends = [b for b in HEADLINE if any(r["backend"] == b for r in runs)]
    headers = ["workload", *[f"{b} prog/s" for b in backends]]
    peers = [p for p in PEERS if p in backends]
    headers += [f"radixrt / {p}" for p in peers] + ["hit/opt radixrt", "hit/opt llama.cpp", "EM / F1"]
    rows = []
    for wl in workload_names(runs):
        cell = {b: _find(runs, wl, b, parallel) for b in backends}
        rx = cell.get("radixrt")
        row = [wl, *[_cell(cell[b], "programs_per_s") for b in backends]]
        for other in peers:
            o = cell.get(other)
            r = _ratio(rx, o)
            row.append(
                "n/a" if o is not None and o["status"] == "n/a" else _num(r, ".2f") + ("x" if r else "")
            )
        lc = cell.get("llama.cpp")
        row += [_cell(rx, "hit_over_optimal"), _cell(lc, "hit_over_optimal")]
        acc = rx if rx and rx["status"] == "ok" else None
        row.append(
            f"{_num(acc.get('exact_match'), '.2f')} / {_num(acc.get('f1'), '.2f')}"
            if acc and acc.get("scored")
            else ""
        )
        rows.append(row)
    return format_table(headers, rows)


def cpu_table(runs: list[dict[str, Any]], parallel: int) -> str:
    """Per workload: CPU seconds per program of each system at ``parallel``; how many times more the
    others spend than radixrt."""
    backends = [b for b in HEADLINE if any(r["backend"] == b for r in runs)]
    others = [b for b in backends if b != "radixrt"]
    headers = ["workload", *backends, *[f"{b} / radixrt" for b in others]]
    rows = []
    for wl in workload_names(runs):
        cell = {b: _find(runs, wl, b, parallel) for b in backends}
        row = [wl, *[_cell(cell[b], "cpu_s_per_program", ".2f") for b in backends]]
        for b in others:
            o = cell[b]
            r = _ratio(o, cell.get("radixrt"), "cpu_s_per_program")
            row.append(
                "n/a" if o is not None and o["status"] == "n/a" else _num(r, ".2f") + ("x" if r else "")
            )
        rows.append(row)
    return format_table(headers, rows)


def detail_table(runs: list[dict[str, Any]]) -> str:
    """Every run: throughput, latencies, tokens, the cache against its optimum, accuracy, output agreement."""
    headers = ["workload", "backend", "par", "progs", "prog/s", "lat p50 s", "lat p99 s", "TTFT p50 s", "TTFT p99 s",
               "prompt tok", "cached tok", "hit rate", "optimal", "hit/opt", "tok/s", "CPU s/prog", "EM", "F1",
               "same as radixrt"]  # fmt: skip
    rows = []
    for r in runs:
        head = [r["workload"], r["backend"], str(r["parallel"]), str(r["programs"])]
        if r["status"] != "ok":
            rows.append(head + [r["status"]] + [""] * (len(headers) - 5))
            continue
        ref = _find(runs, r["workload"], "radixrt", r["parallel"]) or _find(
            runs, r["workload"], "radixrt", None
        )
        same = ""
        if ref is not None and ref["status"] == "ok" and ref is not r:
            n = min(len(ref["output_digests"]), len(r["output_digests"]))
            same = (
                f"{sum(a == b for a, b in zip(ref['output_digests'], r['output_digests'], strict=False))}/{n}"
            )
        rows.append(head + [
            _num(r["programs_per_s"]), _num(r["latency_p50_s"], ".1f"), _num(r["latency_p99_s"], ".1f"),
            _num(r["ttft_p50_s"], ".2f"), _num(r["ttft_p99_s"], ".2f"), str(r["prompt_tokens"]),
            _num(r["cached_tokens"], ".0f"), _num(r["hit_rate"], ".3f"), _num(r["optimum"]["optimal_hit_rate"], ".3f"),
            _num(r["hit_over_optimal"], ".3f"), _num(r["tok_per_s"], ".1f"),
            _num(r.get("cpu_s_per_program"), ".1f"), _num(r["exact_match"], ".2f"),
            _num(r["f1"], ".2f"), same])  # fmt: skip
    return format_table(headers, rows)


def targets(runs: list[dict[str, Any]], parallel: int) -> list[tuple[str, bool | None, str]]:
    """The issue's targets: (name, met (None: not measured), measured value)."""
    out: list[tuple[str, bool | None, str]] = []
    r = _ratio(_find(runs, "react", "radixrt", parallel), _find(runs, "react", "llama.cpp", parallel))
    cpu = _ratio(_find(runs, "react", "llama.cpp", parallel), _find(runs, "react", "radixrt", parallel),
                 "cpu_s_per_program")  # fmt: skip
    out.append((f"react programs/s radixrt / llama.cpp >= 3 (parallel {parallel})", None if r is None else r >= 3,
                f"{_num(r, '.2f')} (CPU seconds per program, llama.cpp / radixrt: {_num(cpu, '.2f')})"))  # fmt: skip
    for b in ("radixrt", "radixrt-engine"):
        ov = _ratio(_find(runs, "react", b, parallel), _find(runs, "react", "openvino", parallel))
        if ov is not None:
            out.append(
                (f"react programs/s {b} / openvino >= 1.5 (parallel {parallel})", ov >= 1.5, f"{ov:.2f}")
            )
    for wl in workload_names(runs):
        for b in ("radixrt", "radixrt-engine"):
            run = _find(runs, wl, b, parallel)
            if run and run["status"] == "ok" and run.get("hit_over_optimal") is not None:
                v = float(run["hit_over_optimal"])
                out.append((f"hit/optimal {b} {wl} >= 0.99", v >= 0.99, f"{v:.4f}"))
    for wl in ("multi_turn", "multi_turn_long"):
        t = _ratio(_find(runs, wl, "radixrt", parallel), _find(runs, wl, "radix-off", parallel), "ttft_p99_s")
        if t is not None:
            out.append(
                (f"{wl} TTFT p99 radixrt / radix-off <= 0.5 (parallel {parallel})", t <= 0.5, f"{t:.2f}")
            )
    return out


def targets_text(runs: list[dict[str, Any]], parallel: int) -> str:
    lines = []
    for name, ok, value in targets(runs, parallel):
        lines.append(f"- {'PASS' if ok else 'FAIL' if ok is not None else 'NOT MEASURED'} `{name}`: {value}")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], throughput_png: Path, hit_png: Path, parallel: int) -> None:
    """programs/s vs parallelism (a panel per workload, a line per system); hit rate per system with the
    workload's optimum (a panel per workload)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = workload_names(runs)
    cols = min(4, len(names)) or 1
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, wl in zip(axes.flat, names, strict=False):
        for b in HEADLINE:
            pts = sorted((r["parallel"], r["programs_per_s"]) for r in runs
                         if r["workload"] == wl and r["backend"] == b and r["status"] == "ok")  # fmt: skip
            if pts:
                label = f"{b} (sequential)" if b == "hf" else b
                ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=label, color=COLORS[b])
        ax.set_title(wl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("programs in flight")
        ax.set_ylabel("programs/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    fig.legend(list(handles.values()), list(handles), loc="lower right", fontsize=8)
    fig.tight_layout()
    throughput_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(throughput_png, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, wl in zip(axes.flat, names, strict=False):
        bars: list[tuple[str, dict[str, Any]]] = []
        for b in HEADLINE:
            r = _find(runs, wl, b, parallel)
            if r is not None and r["status"] == "ok" and r.get("hit_rate") is not None:
                bars.append((b, r))
        ax.bar([b for b, _ in bars], [r["hit_rate"] for _, r in bars], color=[COLORS[b] for b, _ in bars])
        for i, (_, r) in enumerate(bars):
            ax.plot([i - 0.4, i + 0.4], [r["optimum"]["optimal_hit_rate"]] * 2, color="black")
            ax.text(i, r["hit_rate"] + 0.02, _num(r["hit_over_optimal"], ".2f"), ha="center", fontsize=7)
        ax.set_title(f"{wl} (black: optimum; label: hit/opt)", fontsize=9)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("prompt-token hit rate")
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(hit_png, dpi=110)
    plt.close(fig)
