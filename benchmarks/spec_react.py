"""N-gram speculative decoding on the ReAct trace replay: acceptance length and speed-up at batch 1 and 8.

``python -m benchmarks.spec_react [--readme]``: SGLang's ReAct benchmark shape on the embedded model. For
each question of ``--data`` (HotpotQA traces; synthetic ones of the same shape without it): a few-shot
header (the first traces, in full), then per recorded step the model writes its thought and action
(greedy, stop at "Observation"), and the recorded observation is appended, as the benchmark does. Run once with ``--speculative-algorithm NGRAM`` and once
without, same prompts; greedy outputs must be identical (checked).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, format_table, machine_info, update_readme_section, write_json
from benchmarks.react_traces import DATA_HELP, data_label, traces_file
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


def replay(eng: Engine, head: str, questions: list[tuple[str, list[dict[str, str]]]], batch: int,
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", type=Path, default=None, help=DATA_HELP)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--shots", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--readme", action="store_true")
    ns = p.parse_args()
    traces = load_traces(traces_file(ns.data), ns.shots + ns.questions)
    head, questions = header(traces[: ns.shots]), traces[ns.shots :]
    results: dict[str, Any] = {}
    outputs: dict[str, list[str]] = {}
    for spec in tqdm((False, True), desc="speculative off/on"):
        kw: dict[str, Any] = {"max_total_tokens": 60_000, "dtype": ns.dtype}
        if spec:
            kw |= {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": ns.draft_tokens}
        with Engine(**kw) as eng:
            replay(eng, head, questions[:1], 1, 1, 8)  # warm the header into the cache
            for batch in (1, 8):
                before = eng.get_server_info()
                secs, toks, texts = replay(eng, head, questions, batch, ns.steps, ns.new_tokens)
                info = eng.get_server_info()
                key = f"{'on' if spec else 'off'}-b{batch}"
                steps = info.get("spec_verify_reqs", 0) - before.get("spec_verify_reqs", 0)
                acc = info.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
                results[key] = {"seconds": secs, "tokens": toks, "tok_s": toks / secs,
                                "accept_length": 1 + acc / steps if steps else None}  # fmt: skip
                outputs[key] = texts
    same = [
        sum(a == b for a, b in zip(outputs[f"on-b{k}"], outputs[f"off-b{k}"], strict=True)) for k in (1, 8)
    ]
    identical = f"{sum(same)}/{2 * len(outputs['on-b1'])} generations"
    rows = []
    for b in (1, 8):
        off, on = results[f"off-b{b}"], results[f"on-b{b}"]
        rows.append([str(b), f"{off['tok_s']:.1f}", f"{on['tok_s']:.1f}", f"{off['seconds'] / on['seconds']:.2f}x",
                     f"{on['accept_length']:.2f}" if on["accept_length"] else ""])  # fmt: skip
    table = format_table(["batch", "tok/s spec off", "tok/s spec on", "speed-up", "accept length"], rows)
    note = (f"{len(questions)} questions x {ns.steps} steps, {ns.shots}-shot header, greedy, "
            f"{ns.draft_tokens} draft tokens; outputs identical on/off: {identical}")  # fmt: skip
    write_json(RESULTS_DIR / "spec_react.json", {"machine": machine_info(0), "results": results,
                                                  "identical": identical, "args": vars(ns) | {"data": data_label(ns.data)}})  # fmt: skip
    print(table + "\n\n" + note)
    if ns.readme:
        update_readme_section("spec_react", table + "\n\n" + note)


if __name__ == "__main__":
    main()
