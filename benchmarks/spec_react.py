"""Speculative decoding on the ReAct trace replay: off vs NGRAM vs SUFFIX (cold and warm), batch 1 and 8.

``python -m benchmarks.spec_react --data TRACES [--readme]``: SGLang's ReAct benchmark shape on the embedded
model. For each question of ``--data`` (HotpotQA traces; synthetic ones of the same shape without it): a
few-shot header (the first traces, in full), then per recorded step the model writes its thought and
action (greedy, stop at "Observation"), and the recorded observation is appended, as the benchmark does.

One engine per mode (off, NGRAM, SUFFIX), all loaded at once; each repeat runs, per batch size, the
replay twice per mode, interleaving the modes: the first pass is *cold* (SUFFIX's global index emptied
before it), the second *warm* (the same programs served again: SUFFIX drafts from the first pass's
outputs; the RadixCache is warm in both passes for every mode, the header having been served before).
Greedy outputs must be identical across modes (checked). The machine's load average is recorded around
every run, since a shared machine's noise is of the size of the effects.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, format_table, machine_info, update_readme_section, write_json
from benchmarks.react_traces import DATA_HELP, data_label, traces_file
from benchmarks.spec_baseline import BaselineServer
from radixrt import Engine


def load_traces(path: Path, n: int) -> list[tuple[str, list[dict[str, str]]]]:
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            out.extend(json.loads(line).items())
            if len(out) >= n:
                break
    return out[:n]


def header(shots: list[tuple[str, list[dict[str, str]]]]) -> str:
    text = "Solve each question with interleaving Thought, Action, Observation steps.\n\n"
    for q, steps in shots:
        text += q + "\n"
        for i, s in enumerate(steps, 1):
            text += f"Thought {i}: {s['thought']}\nAction {i}: {s['action']}\nObservation {i}: {s['observation']}\n"
        text += "\n"
    return text


def replay(eng: Engine | BaselineServer, head: str, questions: list[tuple[str, list[dict[str, str]]]], batch: int,
           steps: int, new_tokens: int) -> tuple[float, int, list[str]]:  # fmt: skip
    """Replay ``questions`` ``batch`` at a time; returns (seconds, generated tokens, outputs)."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "stop": ["\nObservation"]}
    t0, tokens, texts = time.perf_counter(), 0, []
    for i in range(0, len(questions), batch):
        group = questions[i : i + batch]
        prompts = [head + q + "\n" for q, _ in group]
        for step in range(steps):
            live = [j for j, (_, st) in enumerate(group) if step < len(st)]
            if not live:
                break
            outs = eng.generate(
                prompt=[prompts[j] + f"Thought {step + 1}:" for j in live], sampling_params=params
            )
            for j, out in zip(live, outs, strict=True):
                tokens += out["meta_info"]["completion_tokens"]
                texts.append(out["text"])
                s = group[j][1][step]
                prompts[j] += (f"Thought {step + 1}: {s['thought']}\nAction {step + 1}: {s['action']}\n"
                               f"Observation {step + 1}: {s['observation']}\n")  # fmt: skip
    return time.perf_counter() - t0, tokens, texts


MODES = ("off", "NGRAM", "SUFFIX")


def engine_for(mode: str, ns: argparse.Namespace) -> Engine:
    kw: dict[str, Any] = {"max_total_tokens": 24_000, "dtype": ns.dtype}  # three engines share the RAM
    if mode != "off":
        kw |= {
            "speculative_algorithm": mode,
            "speculative_num_draft_tokens": ns.draft_tokens,
        }  # None: its default
    return Engine(**kw)


BASE = "@base"  # suffix of the modes run by --baseline's tree


def baseline_for(mode: str, ns: argparse.Namespace) -> BaselineServer:
    """``mode`` (NGRAM@base, SUFFIX@base) served by the --baseline tree, flags as `engine_for`'s."""
    flags = [
        "--max-total-tokens",
        "24000",
        "--dtype",
        ns.dtype,
        "--speculative-algorithm",
        mode.removesuffix(BASE),
    ]
    if ns.draft_tokens is not None:  # unset: the tree's own default
        flags += ["--speculative-num-draft-tokens", str(ns.draft_tokens)]
    return BaselineServer(ns.baseline, flags)


def forget_suffix_index(eng: Engine | BaselineServer, head: str) -> None:
    """Empty SUFFIX's global index: the in-process worker rebuilds its speculator at the next decode; a
    baseline server restarts (and gets the header into its cache again)."""
    if isinstance(eng, BaselineServer):
        eng.restart()
        eng.generate(prompt=[head], sampling_params={"temperature": 0, "max_new_tokens": 1})
    else:
        eng.worker.call(lambda s: setattr(s, "_spec", None))


def step_costs(eng: Engine) -> dict[str, Any]:
    """The compiled step's cost model of a speculative engine (radixrt.worker.step_cost): where its time goes."""

    def read(s: Any) -> dict[str, Any]:
        gr = s.runner.graph_runner
        if gr is None:
            return {}
        c = gr.cost
        return {"base_ms": {b: round(v * 1e3, 2) for b, v in c.base.items()}, "scale": c.scale,
                "decode_attention_us_per_position": (c.alpha or 0) * 1e6,
                "verify_attention_us": {"per_position": c.per_position * 1e6, "per_pair": c.per_pair * 1e6,
                                        "scale": c.verify_scale},
                "verify_kernel": getattr(s.runner.backend, "verify_kernel", None)}  # fmt: skip

    out: dict[str, Any] = eng.worker.call(read)
    return out


def run_once(eng: Engine | BaselineServer, head: str, questions: list[tuple[str, list[dict[str, str]]]], batch: int,
             ns: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    before, load0 = eng.get_server_info(), os.getloadavg()[0]
    secs, toks, texts = replay(eng, head, questions, batch, ns.steps, ns.new_tokens)
    info = eng.get_server_info()
    delta = {k: info.get(k, 0) - before.get(k, 0) for k in ("spec_verify_reqs", "spec_accepted_tokens",
             "spec_draft_tokens", "spec_verify_steps", "spec_skipped_batch_steps", "spec_skipped_cost_steps")}  # fmt: skip
    reqs = delta["spec_verify_reqs"]
    return {"seconds": secs, "tokens": toks, "tok_s": toks / secs, "load": [load0, os.getloadavg()[0]],
            "accept_length": 1 + delta["spec_accepted_tokens"] / reqs if reqs else None,
            "index_tokens": info.get("spec_index_tokens"), **delta}, texts  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", type=Path, default=None, help=DATA_HELP)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--shots", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=None,
                   help="--speculative-num-draft-tokens for every mode (default: each algorithm's own)")  # fmt: skip
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--readme", action="store_true")
    p.add_argument("--baseline", type=Path, default=None,
                   help="an earlier radixrt source tree (git archive COMMIT | tar -x -C DIR): its NGRAM and SUFFIX "
                   "run too, as HTTP servers from that tree, interleaved with this tree's modes")  # fmt: skip
    ns = p.parse_args()
    traces = load_traces(traces_file(ns.data), ns.shots + ns.questions)
    head, questions = header(traces[: ns.shots]), traces[ns.shots :]
    batches = [int(b) for b in ns.batches.split(",")]
    modes = [*MODES, *((m + BASE for m in MODES[1:]) if ns.baseline else ())]
    engines: dict[str, Engine | BaselineServer] = {
        m: baseline_for(m, ns) if m.endswith(BASE) else engine_for(m, ns) for m in tqdm(modes, desc="loading")
    }
    runs: list[dict[str, Any]] = []
    outputs: dict[tuple[str, int, str], list[str]] = {}
    try:
        for eng in engines.values():
            replay(eng, head, questions[:1], 1, 1, 8)  # the header into the cache, compile warm-up
        for rep in tqdm(range(ns.repeats), desc="repeats"):
            for batch in batches:
                for mode in modes:
                    if mode.startswith("SUFFIX"):
                        forget_suffix_index(engines[mode], head)
                for pass_ in ("cold", "warm"):
                    for mode in modes:
                        r, texts = run_once(engines[mode], head, questions, batch, ns)
                        runs.append({"repeat": rep, "batch": batch, "pass": pass_, "mode": mode, **r})
                        outputs[(pass_, batch, mode)] = texts
        costs = {
            m: step_costs(eng) for m, eng in engines.items() if m in MODES[1:] and isinstance(eng, Engine)
        }
    finally:
        for eng in engines.values():
            eng.shutdown()
    same = {m: sum(a == b for k, texts in outputs.items() if k[2] == m
                   for a, b in zip(texts, outputs[(k[0], k[1], "off")], strict=True)) for m in modes[1:]}  # fmt: skip
    total = sum(len(t) for k, t in outputs.items() if k[2] == "off")
    identical = ", ".join(f"{m} {n}/{total}" for m, n in same.items())
    rows = []
    for batch in batches:
        for pass_ in ("cold", "warm"):
            sel = {
                m: [r for r in runs if r["batch"] == batch and r["pass"] == pass_ and r["mode"] == m]
                for m in modes
            }
            secs = {m: statistics.median(r["seconds"] for r in rs) for m, rs in sel.items()}
            tok_s = {m: statistics.median(r["tok_s"] for r in rs) for m, rs in sel.items()}
            acc = {m: [r["accept_length"] for r in rs if r["accept_length"]] for m, rs in sel.items()}
            loads = [x for rs in sel.values() for r in rs for x in r["load"]]
            rows.append([str(batch), pass_, f"{tok_s['off']:.1f}"]
                        + [f"{tok_s[m]:.1f} ({secs['off'] / secs[m]:.2f}x, "
                           f"{statistics.median(acc[m]) if acc[m] else 0:.2f})" for m in modes[1:]]
                        + [f"{min(loads):.1f}-{max(loads):.1f}"])  # fmt: skip
    table = format_table(["batch", "pass", "tok/s off", *(f"{m} tok/s (speed-up, accept)" for m in modes[1:]),
                          "load avg"], rows)  # fmt: skip
    note = (f"{len(questions)} questions x {ns.steps} steps, {ns.shots}-shot header, greedy, {ns.new_tokens} new "
            f"tokens at most, {ns.draft_tokens or 'default'} draft tokens, {ns.repeats} repeat(s), medians; modes interleaved "
            f"per pass; outputs identical to off: {identical}")  # fmt: skip
    args = vars(ns) | {"data": data_label(ns.data), "baseline": ns.baseline.name if ns.baseline else None}
    write_json(RESULTS_DIR / "spec_react.json", {"machine": machine_info(0), "runs": runs, "identical": identical,
                                                  "step_costs": costs, "args": args})  # fmt: skip
    print(table + "\n\n" + note + "\n\nstep costs: " + json.dumps(costs))
    if ns.readme:
        update_readme_section("spec_react", table + "\n\n" + note)


if __name__ == "__main__":
    main()
