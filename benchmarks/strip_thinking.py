"""--strip-thinking-cache on a multi-turn reasoning workload: RadixCache hit rate and KV held, with and
without, through /v1/chat/completions.

The workload: ``--conversations`` chats of ``--turns`` turns each, driven round-robin (turn t of every
chat, then turn t+1, ``--concurrency`` at a time), as a reasoning model's clients drive them: each reply is
``--reasoning-tokens`` of reasoning, and the next turn's prompt carries the conversation without it (the
client appends an assistant message with a short answer, then a new user message). The server runs
``--reasoning-parser deepseek-r1``, under which the random-weight model's whole output is reasoning (it never
writes ``</think>``), so every reply's output KV is dead once the reply is done: no later prompt contains it.

Measured per configuration (flag off / on) and KV pool size: the hit rate (cached prompt tokens / prompt
tokens, from ``usage``), the workload's optimum (an unbounded cache seeing the requests one at a time: each
prompt's longest common prefix with any earlier prompt, by ``/tokenize``), and the KV the RadixCache holds
(``kv_cached_tokens``) after each round and at the end.

    python -m benchmarks.strip_thinking            # writes benchmarks/results/strip_thinking.json
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import RESULTS_DIR, bench_checkpoint, format_table, machine_info, write_json
from benchmarks.serving import launch

WORDS = "alpha beta gamma delta kernel cache prefix token radix tree page slot batch graph node".split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversations(n: int, turns: int, seed: int) -> list[dict[str, Any]]:
    """Each chat: a system prompt, its user messages and the answers the client keeps (no reasoning)."""
    rng = random.Random(seed)
    return [
        {
            "system": f"You are assistant {i}. " + _text(rng, 120),
            "users": [_text(rng, 24) for _ in range(turns)],
            "answers": [_text(rng, 12) for _ in range(turns)],
        }
        for i in range(n)
    ]


def messages(chat: dict[str, Any], turn: int) -> list[dict[str, str]]:
    """Turn ``turn``'s prompt: earlier turns' user messages and answers, reasoning dropped."""
    out = [{"role": "system", "content": chat["system"]}]
    for t in range(turn):
        out += [
            {"role": "user", "content": chat["users"][t]},
            {"role": "assistant", "content": chat["answers"][t]},
        ]
    return [*out, {"role": "user", "content": chat["users"][turn]}]


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def optimum(c: httpx.Client, chats: list[dict[str, Any]], turns: int) -> int:
    """Prompt tokens an unbounded cache would serve: each prompt's longest common prefix with any earlier
    prompt (in submission order), at most all but its last token."""
    seen: list[list[int]] = []
    best = 0
    for turn in range(turns):
        for chat in chats:
            r = c.post("/tokenize", json={"messages": messages(chat, turn)})
            r.raise_for_status()
            ids = r.json()["tokens"]
            best += min(max((_lcp(ids, s) for s in seen), default=0), len(ids) - 1)
            seen.append(ids)
    return best


def run(
    url: str, chats: list[dict[str, Any]], turns: int, reasoning: int, concurrency: int
) -> dict[str, Any]:
    """Drive the workload once on an empty cache; the hit rate, the optimum and the KV held."""
    with httpx.Client(base_url=url, timeout=600) as c:
        assert c.post("/flush_cache").status_code == 200
        prompt = cached = 0
        held: list[int] = []

        def one(i: int, turn: int) -> dict[str, Any]:
            body = {"messages": messages(chats[i], turn), "max_tokens": reasoning, "ignore_eos": True,
                    "temperature": 0}  # fmt: skip
            r = c.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            return dict(r.json()["usage"])

        start = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            for turn in range(turns):
                usages = list(pool.map(lambda i, t=turn: one(i, t), range(len(chats))))
                for u in usages:
                    prompt += u["prompt_tokens"]
                    cached += u["prompt_tokens_details"]["cached_tokens"]
                held.append(int(c.get("/get_server_info").json()["kv_cached_tokens"]))
        seconds = time.monotonic() - start
        best = optimum(c, chats, turns)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4),
        "optimal_hit_rate": round(best / prompt, 4),
        "kv_cached_tokens_per_round": held,
        "kv_cached_tokens_end": held[-1],
        "seconds": round(seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reasoning-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pools", type=int, nargs="+", default=[16384, 3072], help="--max-total-tokens values")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=RESULTS_DIR / "strip_thinking.json")
    args = ap.parse_args()
    model = bench_checkpoint("tiny", context=4096)
    chats = conversations(args.conversations, args.turns, args.seed)
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for pool in args.pools:
            for strip in (False, True):
                flags = [
                    "--max-total-tokens",
                    str(pool),
                    "--reasoning-parser",
                    "deepseek-r1",
                    "--disable-compile",
                ]
                flags += ["--strip-thinking-cache"] if strip else []
                proc, url = launch(model, flags, Path(tmp) / "server.log", args.threads)
                try:
                    res = run(url, chats, args.turns, args.reasoning_tokens, args.concurrency)
                finally:
                    proc.terminate()
                    proc.wait(60)
                results.append({"kv_pool_tokens": pool, "strip_thinking_cache": strip, **res})
                print(results[-1], flush=True)
                rows.append([str(pool), "on" if strip else "off", f"{res['hit_rate']:.3f}",
                             f"{res['optimal_hit_rate']:.3f}", str(max(res["kv_cached_tokens_per_round"])),
                             str(res["kv_cached_tokens_end"])])  # fmt: skip
    workload = {
        k: getattr(args, k) for k in ("conversations", "turns", "reasoning_tokens", "concurrency", "seed")
    }
    write_json(args.output, {"machine": machine_info(args.threads), "workload": workload, "results": results})
    print(
        format_table(
            ["KV pool", "--strip-thinking-cache", "hit rate", "optimum", "KV held (max)", "KV held (end)"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
