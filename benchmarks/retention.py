"""Cache retention benchmark: the runtime's LRU and program-aware retention against Belady's optimum.

For each workload (ReAct trace replay, multi-turn chat, tree of thought; the programs of
``benchmarks.agents``) a radixrt server runs the programs with ``run_batch`` (greedy, short outputs),
first with an unbounded KV pool (the working set W = the union trie of every request's tokens), then
with a pool of ``fraction * W`` tokens for each ``--fractions`` entry, once per policy:

- ``lru``: ``--radix-eviction-policy lru``, the frontend's retention hints off;
- ``program-aware``: ``--radix-eviction-policy priority`` and the frontend's hints on (every request
  carries its program's priority, shared prefixes are pinned; ``frontend_lang.retention``).

Each run records its trace (prompt ids and the ids whose KV the request computed, in the order the
server served them) and the runtime's hit tokens (``meta_info.cached_tokens``). The server serves one
request at a time (``--max-running-requests 1``, ``--schedule-policy fcfs``; the programs still
interleave: ``--parallel`` run at once), so the trace order is the service order and
`benchmarks.belady` replays it exactly: Belady on the same trace is the reference, and LRU simulated
on the LRU run's trace must equal the runtime's LRU hits (the cross-check).

Writes benchmarks/results/retention.json and retention.png and prints a markdown table.
``--quick``: one small ReAct run at 50% memory (a smoke test: three server starts).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.agents import multi_turn, react, tot
from benchmarks.agents.data import load_traces
from benchmarks.agents.workload import Scale, Workload
from benchmarks.belady import TraceRequest, simulate, working_set
from benchmarks.common import write_json
from benchmarks.react_traces import DATA_HELP, traces_file
from frontend_lang import Runtime, RuntimeEndpoint

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = {"lru": ("lru", False), "program-aware": ("priority", True)}  # eviction policy, hints
UNBOUNDED = 1 << 16  # the "unbounded" pool: more than any workload here holds


@dataclass(slots=True)
class Served:
    """One request as the server served it."""

    prompt: list[int]
    computed: list[int]  # ids after the prompt whose KV the request computed (its output but the last)
    cached: int | None  # the runtime's hit tokens (None: not reported, a pin)
    priority: int
    hit_limit: int | None  # prompt logprobs from logprob_start_len: the cache serves fewer tokens
    done: float  # client clock when the answer arrived (the service order: one request at a time)
    seq: int  # arrival order of the answers, then position in a batch


class TraceEndpoint(RuntimeEndpoint):
    """A ``RuntimeEndpoint`` that writes down every request it sends (pins included)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served: list[Served] = []
        self._rec_lock = threading.Lock()

    def _record(self, payload: dict[str, Any], prompts: list[list[int]], outs: list[dict[str, Any]]) -> None:
        done = time.perf_counter()
        starts = payload.get("logprob_start_len") if payload.get("return_logprob") else None
        limits = starts if isinstance(starts, list) else [starts] * len(prompts)
        with self._rec_lock:
            for prompt, out, start in zip(prompts, outs, limits, strict=True):
                ids = list(out.get("output_ids") or [])
                cached = out.get("meta_info", {}).get("cached_tokens")
                limit = None if start is None else max(int(start) - 1, 0)
                prio = int(payload.get("priority", 0))
                self.served.append(Served(prompt, ids[:-1], cached, prio, limit, done, len(self.served)))

    def _prompts(self, payload: dict[str, Any]) -> list[list[int]]:
        if payload.get("input_ids") is not None:
            ids = payload["input_ids"]
            return [list(x) for x in ids] if ids and isinstance(ids[0], list) else [list(ids)]
        text = payload["text"]
        return [self._encode(t) for t in (text if isinstance(text, list) else [text])]

    def _call(self, payload: dict[str, Any]) -> Any:
        out = super()._call(payload)
        self._record(payload, self._prompts(payload), out if isinstance(out, list) else [out])
        return out

    def _pin(self, body: dict[str, Any]) -> dict[str, Any]:
        out = super()._pin(body)
        self._record({}, [self._encode(body["text"])], [{"meta_info": {}}])
        return out

    def trace(self) -> tuple[list[TraceRequest], list[int | None]]:
        """The served requests in service order, and the runtime's hit tokens of each."""
        order = sorted(self.served, key=lambda s: (s.done, s.seq))
        return [TraceRequest(s.prompt, s.computed, None, s.priority, s.hit_limit) for s in order], [
            s.cached for s in order
        ]


def build_workloads(data: Path, names: list[str], quick: bool) -> dict[str, tuple[Workload, int]]:
    """(workload, programs) by name; the small suite's sizes (smaller with ``quick``)."""
    traces = load_traces(data)
    scale = Scale(react_max_tokens=8, react_replay_steps=1 if quick else 2, chat_turns=3, chat_user_words=30,
                  chat_short_answer=8, tot_breadth=2, tot_depth=2, tot_max_tokens=8)  # fmt: skip
    n = 4 if quick else 16
    out: dict[str, tuple[Workload, int]] = {}
    for name in names:
        if name == "react":
            out[name] = (react.replay_workload(traces, scale), n)
        elif name == "multi_turn":
            out[name] = (multi_turn.workloads(traces, scale, instances=n)[0], n)
        elif name == "tot":
            out[name] = (tot.workload(traces, scale), max(2, n // 3))
        else:
            raise ValueError(f"workloads: unknown workload {name!r} (react, multi_turn, tot)")
    return out


def tiny_model() -> Path:
    """The tiny random Llama (BPE tokenizer, ChatML template) the benchmark runs by default."""
    from radixrt.config.cache_dir import cache_dir
    from radixrt.testing.random_checkpoint import make_checkpoint

    out = cache_dir() / "retention_tiny_llama"
    if not (out / "config.json").exists():
        make_checkpoint(out, arch="llama", size="tiny", seed=0)
    return out


def run_once(model: str, wl: Workload, programs: int, parallel: int, capacity: int, policy: str,
             log_dir: Path) -> dict[str, Any]:  # fmt: skip
    """One server run of ``programs`` instances; the runtime's hits and the simulated ones."""
    eviction, hints = POLICIES[policy]
    flags: dict[str, Any] = dict(max_total_tokens=capacity, radix_eviction_policy=eviction, schedule_policy="fcfs",
                 max_running_requests=1, dtype="float32", disable_compile=True)  # fmt: skip
    log = log_dir / f"{wl.name}-{policy}-{capacity}.log"
    with Runtime(model, retention=False, log_file=log, **flags) as rt:
        ep = TraceEndpoint(rt.url, retention=hints)
        try:
            start = time.perf_counter()
            states = wl.program.run_batch(wl.take(programs), backend=ep, num_threads=parallel,
                                          progress_bar=False, temperature=0)  # fmt: skip
            wall = time.perf_counter() - start
            errors = [f"{type(e).__name__}: {e}" for s in states if (e := s.error()) is not None]
            if errors:
                raise RuntimeError(f"{wl.name} ({policy}, {capacity} tokens): {errors[0]}")
            stats = ep.get_server_info()
        finally:
            ep.shutdown()
    trace, cached = ep.trace()
    runtime_hits = int(stats["cached_tokens"])
    sims = {p: simulate(trace, None if capacity >= UNBOUNDED else capacity, p).hit_tokens
            for p in ("lru", "priority", "belady")}  # fmt: skip
    reported = [c for c in cached if c is not None]
    return {
        "policy": policy,
        "capacity": capacity,
        "requests": len(trace),
        "prompt_tokens": sum(len(r.prompt) for r in trace),
        "working_set": working_set(trace),
        "max_request": max(len(r.prompt) + len(r.output) for r in trace),
        "runtime_hits": runtime_hits,
        "runtime_hits_reported": sum(reported),
        "sim": sims,
        "fraction_of_belady": runtime_hits / sims["belady"] if sims["belady"] else None,
        "wall_s": wall,
        "_trace": trace,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| workload | memory | LRU / Belady | program-aware / Belady | Belady hit tokens (LRU trace) | "
            "runtime LRU = simulated LRU | working set |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lru, pa = r["runs"]["lru"], r["runs"]["program-aware"]
        check = (
            "yes"
            if lru["runtime_hits"] == lru["sim"]["lru"]
            else f"{lru['runtime_hits']} vs {lru['sim']['lru']}"
        )
        lines.append(
            f"| {r['workload']} | {r['fraction']:.0%} ({r['capacity']} tok) | {lru['fraction_of_belady']:.1%} | "
            f"{pa['fraction_of_belady']:.1%} | {lru['sim']['belady']} | {check} | {r['working_set']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['workload']}\n{r['fraction']:.0%} mem" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    for k, (policy, color) in enumerate((("lru", "#999999"), ("program-aware", "#1f77b4"))):
        vals = [100 * (r["runs"][policy]["fraction_of_belady"] or 0) for r in rows]
        ax.bar([x + (k - 0.5) * 0.38 for x in xs], vals, 0.38, label=policy, color=color)
    ax.axhline(95, color="#d62728", linestyle="--", linewidth=1, label="target 95%")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("hit tokens, % of Belady's")
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right")
    ax.set_title("radixrt prefix-cache retention vs Belady (same recorded trace)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--react-data", type=Path, default=None, help=DATA_HELP)
    p.add_argument("--model-path", default=None, help="default: a tiny random Llama (built once)")
    p.add_argument("--workloads", default="react,multi_turn,tot")
    p.add_argument("--fractions", default="0.25,0.5", help="KV pool sizes as fractions of the working set")
    p.add_argument("--parallel", type=int, default=8, help="programs in flight")
    p.add_argument("--quick", action="store_true", help="one small ReAct run at 50%% memory (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS / "retention.json")
    p.add_argument("--traces-dir", type=Path, default=None, help="also save each run's trace here")
    args = p.parse_args(argv)
    names = ["react"] if args.quick else [w for w in args.workloads.split(",") if w]
    fractions = [0.5] if args.quick else [float(f) for f in args.fractions.split(",")]
    parallel = 4 if args.quick else args.parallel
    model = args.model_path or str(tiny_model())
    workloads = build_workloads(traces_file(args.react_data), names, args.quick)
    log_dir = Path(tempfile.mkdtemp(prefix="retention-logs-"))
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(names) * (1 + 2 * len(fractions)), desc="retention runs")
    for name, (wl, programs) in workloads.items():
        bar.set_postfix_str(f"{name} unbounded")
        full = run_once(model, wl, programs, parallel, UNBOUNDED, "lru", log_dir)
        bar.update(1)
        ws = full["working_set"]
        for frac in fractions:
            # NOTE: the pool must hold the longest request (with room to decode); then more than frac
            capacity = max(int(frac * ws), full["max_request"] + 32)
            runs = {}
            for policy in POLICIES:
                bar.set_postfix_str(f"{name} {frac:.0%} {policy}")
                runs[policy] = run_once(model, wl, programs, parallel, capacity, policy, log_dir)
                bar.update(1)
            rows.append({"workload": name, "fraction": frac, "capacity": capacity, "working_set": ws,
                         "capacity_over_working_set": capacity / ws,
                         "unbounded_hits": full["runtime_hits"], "runs": runs})  # fmt: skip
    bar.close()
    if args.traces_dir is not None:
        args.traces_dir.mkdir(parents=True, exist_ok=True)
        for r in rows:
            for policy, run in r["runs"].items():
                path = args.traces_dir / f"{r['workload']}-{r['fraction']}-{policy}.json"
                path.write_text(json.dumps({"requests": [asdict(t) for t in run["_trace"]]}))
    for r in rows:
        for run in r["runs"].values():
            run.pop("_trace")
    result = {"model": model, "parallel": parallel, "quick": args.quick, "rows": rows}
    table = markdown(rows)
    print(table)
    if not args.quick:
        write_json(args.out, result)  # no machine paths
        plot(rows, args.out.with_suffix(".png"))
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
