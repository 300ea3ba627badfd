"""``python -m benchmarks.agents``: the agent / RAG benchmark suite (see ``benchmarks/agents/__init__.py``)."""

from __future__ import annotations  # noqa: I001 - radixrt first (below)

import radixrt  # noqa: F401 - before torch: bounds libgomp's spin-waiting (radixrt/worker/threads.py)
import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.agents.backends import ALL_BACKENDS
from benchmarks.agents.report import cpu_table, detail_table, headline_table, plot, targets_text
from benchmarks.agents.suite import WORKLOADS, build_workloads, jsonl_writer, run_suite
from benchmarks.agents.workload import Scale
from benchmarks.common import RESULTS_DIR, machine_info, update_readme_section, write_json
from benchmarks.react_traces import DATA_HELP, data_label, traces_file


def _list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in _list(s)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agents", description=__doc__)
    p.add_argument("--data", type=Path, default=None, help=f"{DATA_HELP}; read in place")
    p.add_argument(
        "--workloads", type=_list, default=list(WORKLOADS), help=f"comma list of {','.join(WORKLOADS)}"
    )
    p.add_argument(
        "--backends",
        type=_list,
        default=None,
        help=f"comma list of {','.join(ALL_BACKENDS)},url (default: all; url with --base-url)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="full size: SGLang's workload sizes, --parallel 1,4,8,16 on every backend, 2 waves",
    )
    p.add_argument(
        "--parallel", type=_ints, default=None, help="programs in flight for the sweep (default 1,8)"
    )
    p.add_argument(
        "--sweep-backends",
        type=_list,
        default=None,
        help="backends run at every --parallel (default radixrt; full: all); the rest at --headline",
    )
    p.add_argument("--headline", type=int, default=8, help="the parallelism of the summary table (default 8)")
    p.add_argument(
        "--min-programs", type=int, default=2, help="programs per run: max(parallel, this) x --waves"
    )
    p.add_argument("--waves", type=int, default=None, help="default 1 (full: 2)")
    p.add_argument(
        "--hf-programs", type=int, default=None, help="programs per HF run (sequential; default 1, full 4)"
    )
    p.add_argument("--kv-tokens", type=int, default=65536, help="radixrt KV pool (ample for every workload)")
    p.add_argument("--model-path", default=None, help="radixrt/HF model (default: the embedded SmolLM2-135M)")
    p.add_argument(
        "--gguf", default=None, help="llama.cpp's and OpenVINO's model file (default: the embedded GGUF)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) - 1),
        help="compute threads of every system (radixrt worker, Engine, llama.cpp, HF); default: cores - 1, "
        "what radixrt's server picks (a core stays for the HTTP side and the client)",
    )
    p.add_argument("--llama-ctx", type=int, default=8192)
    p.add_argument(
        "--hf-dtype", default="bfloat16", help="HF transformers dtype (radixrt's auto is bf16 here)"
    )
    p.add_argument("--base-url", default=None, help="any OpenAI-compatible server (adds the `url` backend)")
    p.add_argument("--base-url-model", default="default")
    p.add_argument(
        "--base-url-tokenizer", default=None, help="its model's HF directory (token counts, template)"
    )
    p.add_argument(
        "--base-url-select", action="store_true", help="it returns prompt logprobs (echo + logprobs)"
    )
    p.add_argument("--base-url-api-key", default=None)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "agents.json")
    p.add_argument("--plot-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/radixrt-agents-logs"))
    p.add_argument("--readme", action="store_true", help="write the summary into docs/benchmarks.md")
    p.add_argument(
        "--readme-section", default="agents", help="its section there (another name keeps the suite's own)"
    )
    p.add_argument(
        "--from-json", type=Path, default=None, help="re-render plots/tables/README from a saved --out"
    )
    ns = p.parse_args(argv)
    ns.backends = ns.backends or [*ALL_BACKENDS, *(["url"] if ns.base_url else [])]
    ns.parallel = ns.parallel or ([1, 4, 8, 16] if ns.full else [1, 8])
    ns.sweep_backends = ns.sweep_backends or (list(ns.backends) if ns.full else ["radixrt"])
    ns.waves = ns.waves or (2 if ns.full else 1)
    ns.hf_programs = ns.hf_programs or (4 if ns.full else 1)
    if "url" in ns.backends and not ns.base_url:
        p.error("the url backend needs --base-url")
    if ns.data is not None and not ns.data.is_file():
        p.error(f"--data {ns.data}: no such file")
    return ns


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json is not None:  # re-render tables, plots and README from a saved run
        render(json.loads(args.from_json.read_text(encoding="utf-8")), args)
        return
    # NOTE: one compute thread per system on this shared 2-core machine: with 2 threads, llama.cpp decoded
    # at 2.7 tok/s instead of 67 and HF's prefill varied 2-25 s while another job held a core (spinning
    # thread barriers); radixrt's server worker reads OMP_NUM_THREADS, the in-process Engine too.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    scale = Scale.full() if args.full else Scale()
    workloads = build_workloads(traces_file(args.data), scale, args.workloads)
    info = machine_info(args.threads)
    t0 = time.perf_counter()
    runs = run_suite(args, workloads, jsonl_writer(args.out.with_name(args.out.stem + "_runs.jsonl")))
    info |= {"suite_wall_s": time.perf_counter() - t0, "load_avg_at_end": list(os.getloadavg())}
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings["data"] = data_label(args.data)
    data = {"machine": info, "args": settings, "scale": {f: getattr(scale, f) for f in scale.__slots__},
            "workloads": {w.name: w.description for w in workloads}, "runs": runs}  # fmt: skip
    write_json(args.out, data)
    render(data, args)


def render(data: dict[str, Any], args: argparse.Namespace) -> None:
    """Plots, the summary on stdout and (``--readme``) the README section, from one suite's results."""
    runs, info, headline = data["runs"], data["machine"], int(data["args"]["headline"])
    plot(runs, args.plot_dir / "agents_programs_per_s.png", args.plot_dir / "agents_hit_rate.png", headline)
    summary, cpu = headline_table(runs, headline), cpu_table(runs, headline)
    details, goals = detail_table(runs), targets_text(runs, headline)
    print(f"\n{summary}\n\n{cpu}\n\n{goals}\n\n{details}\n")
    if not args.readme:
        return
    systems = dict.fromkeys(f"- `{r['backend']}`: {r['system']}" for r in runs if r.get("system"))
    size = "full" if data["args"]["full"] else "default (small)"
    load = [
        round(x, 1)
        for x in (info.get("load_avg_at_start") or [])[:1] + (info.get("load_avg_at_end") or [])[:1]
    ]
    wall = f", {info['suite_wall_s'] / 60:.0f} min for the whole suite" if info.get("suite_wall_s") else ""
    a = data["args"]
    cmd = "python -m benchmarks.agents --readme" + (
        ""
        if args.readme_section == "agents"
        else f" --readme-section {args.readme_section} --workloads {','.join(a['workloads'])} --backends "
        f"{','.join(a['backends'])} --threads {a['threads']} --min-programs {a['min_programs']}"
    )
    text = (f"`{cmd}` (data: {a['data']}): {size} size, {info['date']}, {info['cpu_cores']} CPU cores, "
            f"{info['torch_threads']} compute thread(s) per system, load average {' -> '.join(map(str, load))} "
            f"(start -> end){wall}. Programs/s at parallel {headline} (hf: sequential, parallel 1):\n\n{summary}"
            f"\n\nCPU seconds per program (the system's own processes; outside load inflates wall time, much less "
            f"this):\n\n{cpu}\n\n{goals}\n\n<details><summary>every run</summary>\n\n{details}\n\n</details>\n\n"
            "Systems:\n" + "\n".join(systems) + "\n\nWorkloads:\n"
            + "\n".join(f"- `{name}`: {desc}" for name, desc in data["workloads"].items())
            + _image(args.plot_dir / "agents_programs_per_s.png", "programs/s vs parallelism")
            + _image(args.plot_dir / "agents_hit_rate.png", "hit rate vs optimum"))  # fmt: skip
    update_readme_section(args.readme_section, text)


def _image(path: Path, alt: str) -> str:
    """A link to a plot written inside benchmarks/ (results/...), none to one written elsewhere."""
    rel = os.path.relpath(path.resolve(), RESULTS_DIR.parent)
    return "" if rel.startswith("..") else f"\n\n![{alt}]({rel})"


if __name__ == "__main__":
    main()
