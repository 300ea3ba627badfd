"""Scale-out: one radixrt server vs four behind the real sglang-router (issue 15), and TP=1 vs TP=2.

``python -m benchmarks.scale_out [--readme]`` runs two workloads against three setups:

- ``single``: one server with the whole KV budget (``--kv-tokens``);
- ``cache_aware`` / ``round_robin``: ``radixrt serve --dp-size 4 --router-policy P`` (four servers, each with
  a quarter of the budget as its ``--max-total-tokens``, behind ``python -m sglang_router.launch_router``).

Workloads (text prompts: the router's cache-aware tree matches request text; one random-vocabulary word is
one token of the benchmark tokenizer):

- ``shared``: SGLang bench_serving's ``generated-shared-prefix`` shape: ``--groups`` system prompts, each
  followed by ``--prompts-per-group`` questions, all requests shuffled (groups arrive interleaved);
- ``chat``: multi-turn chat: ``--convs`` conversations (a short system prompt shared by all, a long first
  message of its own), ``--turns`` turns each; turn k+1's prompt is turn k's prompt + its answer + a new
  user message; conversations run concurrently, each turn after the previous one.

Hit rate = cached prompt tokens / prompt tokens, summed over the servers' own counters
(``/get_server_info`` before and after, so warm-up requests do not count); the optimum is the union trie of
all prompts (each distinct prefix computed once). Each request streams, so TTFT is measured at the client.
On this 2-core machine the four DP servers share the two cores with each other (and with the router and
the client): their throughput and TTFT are NOT a scale-out measurement; the hit rate and the prefill tokens
computed are, and the targets judge those. The TP part runs ``benchmarks.tp_speed.measure`` (88M model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common import (
    REPO_ROOT,
    RESULTS_DIR,
    bench_checkpoint,
    format_table,
    machine_info,
    update_readme_section,
    write_json,
)
from benchmarks.prefix_workloads import optimum
from benchmarks.serving_workload import Outcome, summarize
from radixrt.models.tokenizer import load_tokenizer

THROUGHPUT_CAVEAT = (
    "2-core machine: the four DP servers, the router and the client share two cores, so DP throughput and "
    "TTFT are not a scale-out measurement (judge the hit rate and prefill tokens)"
)
START_TIMEOUT_S = 300.0
COUNTERS = ("num_requests", "prompt_tokens", "cached_tokens", "computed_prefill_tokens")


@dataclass(frozen=True, slots=True)
class Setup:
    name: str
    dp_size: int
    policy: str | None = None


SETUPS = (Setup("single", 1), Setup("cache_aware", 4, "cache_aware"), Setup("round_robin", 4, "round_robin"))


# -- workloads (text) ----------------------------------------------------------------------------------
def word_list(model: Path) -> list[str]:
    """Whole-word tokens of the model's tokenizer: a text of n of them is n tokens."""
    vocab = load_tokenizer(str(model)).get_vocab()
    return sorted(" " + w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3)


def _text(rng: random.Random, words: list[str], n: int) -> str:
    return "".join(rng.choice(words) for _ in range(n))


def shared_prefix_prompts(ns: argparse.Namespace, words: list[str]) -> list[str]:
    rng = random.Random(ns.seed)
    prompts = []
    for _ in range(ns.groups):
        system = "System:" + _text(rng, words, ns.system_len)
        prompts += [f"{system}\nUser:{_text(rng, words, ns.question_len)}\nAssistant:"
                    for _ in range(ns.prompts_per_group)]  # fmt: skip
    rng.shuffle(prompts)
    return prompts


def chat_conversations(ns: argparse.Namespace, words: list[str]) -> list[list[str]]:
    """Per conversation, the user messages of its turns (the first one opens with the shared system prompt)."""
    rng = random.Random(ns.seed + 1)
    system = "System:" + _text(rng, words, ns.chat_system_len)
    return [[f"{system}\nUser:{_text(rng, words, ns.first_len)}\nAssistant:"]
            + [f"\nUser:{_text(rng, words, ns.user_len)}\nAssistant:" for _ in range(ns.turns - 1)]
            for _ in range(ns.convs)]  # fmt: skip


# -- deployments ---------------------------------------------------------------------------------------
def _port_run(n: int) -> int:
    """A port p with p .. p + n - 1 free."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n < 65535 and all(_free(p) for p in range(base, base + n)):
            return base
    raise RuntimeError("no run of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ready(url: str, servers: list[str], dp: bool) -> bool:
    try:
        if not dp:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        workers = httpx.get(url + "/workers", timeout=2).json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return False
    return sorted(w["url"] for w in workers if w.get("is_healthy")) == sorted(servers)


@contextmanager
def deploy(
    setup: Setup, model: Path, kv_tokens: int, log: Path, timing: dict[str, float]
) -> Iterator[tuple[str, list[str]]]:
    """Start the setup (one ``radixrt.entrypoints.launch_server`` command); yields (front URL, server URLs).
    ``timing`` receives the seconds to ready and to stop."""
    base = _port_run(setup.dp_size + 2)  # router (or the server), DP servers, router metrics
    per_server = kv_tokens // setup.dp_size
    cmd = [sys.executable, "-m", "radixrt.entrypoints.launch_server", "--model-path", str(model), "--port", str(base),
           "--max-total-tokens", str(per_server), "--disable-compile", "--dtype", "float32"]  # fmt: skip
    ports = [base]
    if setup.dp_size > 1:
        assert setup.policy is not None
        cmd += ["--dp-size", str(setup.dp_size), "--router-policy", setup.policy,
                "--router-dp-worker-base-port", str(base + 1)]  # fmt: skip
        ports = [base + 1 + i for i in range(setup.dp_size)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}  # one thread per worker
    front, servers = f"http://127.0.0.1:{base}", [f"http://127.0.0.1:{p}" for p in ports]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    t0 = time.monotonic()
    try:
        while not _ready(front, servers, setup.dp_size > 1):
            if proc.poll() is not None or time.monotonic() > t0 + START_TIMEOUT_S:
                raise RuntimeError(f"{setup.name}: not ready; log tail:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        timing["startup_s"] = time.monotonic() - t0
        yield front, servers
    finally:
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        timing["stop_s"] = time.monotonic() - t1


def counters(servers: list[str]) -> list[dict[str, float]]:
    out = []
    for url in servers:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        out.append({k: float(info[k]) for k in COUNTERS})
    return out


def flush(servers: list[str]) -> None:
    """Empty every server's cache (they are idle once the client has its answers; retry until so)."""
    for url in servers:
        for _ in range(100):
            if httpx.post(url + "/flush_cache", timeout=30).status_code == 200:
                break
            time.sleep(0.1)


# -- the client ----------------------------------------------------------------------------------------
async def generate(client: httpx.AsyncClient, text: str, max_new: int) -> tuple[Outcome, str, list[int]]:
    """One streamed /generate: the outcome, the answer's text and ids."""
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    out, answer = Outcome(), ""
    ids: list[int] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    raise RuntimeError(str(data["error"]))
                meta = data["meta_info"]
                if meta["completion_tokens"] > 0 and out.output_len == 0:
                    out.ttft = time.perf_counter() - start
                out.output_len, out.cached_tokens = meta["completion_tokens"], meta["cached_tokens"]
                out.prompt_len = meta["prompt_tokens"]
                answer, ids = data.get("text", answer), data.get("output_ids", ids)
        out.e2e = time.perf_counter() - start
        out.ok = out.output_len == max_new
        out.error = "" if out.ok else f"got {out.output_len} of {max_new} tokens"
    except Exception as exc:  # recorded, counted as a failure
        out.error = f"{type(exc).__name__}: {exc}"
    return out, answer, ids


async def run_shared(
    url: str, prompts: list[str], ns: argparse.Namespace, bar: tqdm
) -> list[tuple[Any, ...]]:
    limit = asyncio.Semaphore(ns.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:

        async def one(text: str) -> tuple[Any, ...]:
            async with limit:
                out, _, ids = await generate(client, text, ns.output_len)
            bar.update(1)
            return out, text, ids

        return list(await asyncio.gather(*map(one, prompts)))


async def run_chat(
    url: str, convs: list[list[str]], ns: argparse.Namespace, bar: tqdm
) -> list[tuple[Any, ...]]:
    limit = asyncio.Semaphore(ns.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:

        async def conversation(messages: list[str]) -> list[tuple[Any, ...]]:
            history, done = "", []
            for message in messages:
                prompt = history + message
                async with limit:
                    out, answer, ids = await generate(client, prompt, ns.chat_output_len)
                bar.update(1)
                done.append((out, prompt, ids))
                history = prompt + answer
            return done

        return [r for conv in await asyncio.gather(*map(conversation, convs)) for r in conv]


def measure(setup: Setup, model: Path, ns: argparse.Namespace, workloads: dict[str, Any], log_dir: Path,
            bar: tqdm) -> tuple[dict[str, Any], dict[str, float]]:  # fmt: skip
    """Every workload on one fresh deployment of ``setup`` (caches flushed in between); also the
    deployment's seconds to ready and to stop."""
    tok = load_tokenizer(str(model))
    results: dict[str, Any] = {}
    timing: dict[str, float] = {}
    with deploy(setup, model, ns.kv_tokens, log_dir / f"{setup.name}.log", timing) as (front, servers):
        for name, work in workloads.items():
            flush(servers)
            before = counters(servers)
            bar.set_description(f"{setup.name} / {name}")
            t0 = time.perf_counter()
            run = run_shared if name == "shared" else run_chat
            done = asyncio.run(run(front, work, ns, bar))
            wall = time.perf_counter() - t0
            after = counters(servers)
            delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]
            total = {k: sum(d[k] for d in delta) for k in COUNTERS}
            s = summarize([o for o, _, _ in done], wall)
            best = optimum([(tok.encode(p, add_special_tokens=False), ids) for _, p, ids in done])
            results[name] = {
                "hit_rate": total["cached_tokens"] / max(total["prompt_tokens"], 1),
                "hit_rate_client": s["cache_hit_rate"],  # sum of meta_info cached_tokens / prompt tokens
                "optimal_hit_rate": best.optimal_hit_rate,
                "prompt_tokens": total["prompt_tokens"],
                "prefill_computed": total["computed_prefill_tokens"],
                "optimal_computed": best.optimal_computed,
                "requests_per_server": [int(d["num_requests"]) for d in delta],
                "completed": s["completed"], "failed": s["failed"], "errors": s["errors"],
                "duration_s": wall, "request_throughput": s["request_throughput"],
                "total_token_throughput": s["total_token_throughput"],
                "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            }  # fmt: skip
    return results, timing


def tensor_parallel(new_tokens: int, repeats: int) -> dict[str, Any]:
    """``benchmarks.tp_speed.measure`` at TP=1 and TP=2, alternately ``repeats`` times; per size the run
    with the best batch-8 decode (other jobs on this machine slow single runs down several-fold)."""
    from benchmarks.tp_speed import measure as tp_measure

    best: dict[str, Any] = {}
    for _, n in tqdm([(r, n) for r in range(repeats) for n in (1, 2)], desc="tp sizes"):
        run = tp_measure(n, (1, 8), new_tokens)
        key = f"TP={n}"
        if key not in best or run["decode"]["8"] > best[key]["decode"]["8"]:
            best[key] = run
    return best


# -- report --------------------------------------------------------------------------------------------
def targets(res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """cache_aware's hit rate within 5% of the single server's and >= 2x round_robin's (shared prefix)."""
    single, ca, rr = (res[s]["shared"]["hit_rate"] for s in ("single", "cache_aware", "round_robin"))
    return {
        "cache_aware_vs_single": ca / single if single else 0.0,
        "cache_aware_within_5pct_of_single": ca >= 0.95 * single,
        "cache_aware_vs_round_robin": ca / rr if rr else float("inf"),
        "cache_aware_2x_round_robin": ca >= 2 * rr,
    }


def dp_table(res: dict[str, dict[str, Any]]) -> str:
    rows = []
    for wl in next(iter(res.values())):
        for setup, r in res.items():
            rows.append([wl, setup, f"{r[wl]['hit_rate']:.3f}", f"{r[wl]['optimal_hit_rate']:.3f}",
                         f"{r[wl]['prefill_computed']:.0f}", f"{r[wl]['request_throughput']:.1f}",
                         f"{r[wl]['total_token_throughput']:.0f}",
                         f"{r[wl]['ttft_p50_ms']:.0f} / {r[wl]['ttft_p99_ms']:.0f}",
                         "/".join(map(str, r[wl]["requests_per_server"]))])  # fmt: skip
    head = ["workload", "setup", "hit rate", "optimal", "prefill computed", "req/s*", "tok/s*",
            "TTFT p50 / p99 ms*", "requests per server"]  # fmt: skip
    return format_table(head, rows)


def tp_table(tp: dict[str, Any]) -> str:
    rows = [[name, f"{r['decode']['1']:.0f}", f"{r['decode']['8']:.0f}", f"{r['prefill_512']:.0f}",
             f"{100 * r['all_reduce_share']['1']:.0f}% / {100 * r['all_reduce_share']['8']:.0f}%"]
            for name, r in tp.items()]  # fmt: skip
    return format_table(["", "decode b1 tok/s", "decode b8 tok/s", "prefill 512 tok/s", "all-reduce share b1 / b8"],
                        rows)  # fmt: skip


def plot(res: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(next(iter(res.values())))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(res)
    for i, (setup, r) in enumerate(res.items()):
        xs = [j + i * width for j in range(len(workloads))]
        bars = ax.bar(xs, [r[w]["hit_rate"] for w in workloads], width, label=setup)
        ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=6)
    for j, w in enumerate(workloads):
        best = res["single"][w]["optimal_hit_rate"]
        ax.hlines(
            best, j - width / 2, j + width * (len(res) - 0.5), colors="0.3", linestyles="dashed", linewidth=1
        )
    ax.set_xticks([j + width * (len(res) - 1) / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("prompt-token hit rate (dashed: optimum)")
    ax.set_ylim(0, 1.05)
    ax.set_title("1 server (whole KV) vs 4 behind sglang-router (1/4 KV each)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="bench_checkpoint size")
    p.add_argument("--kv-tokens", type=int, default=32768, help="the single server's KV; each DP server 1/4")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--convs", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--chat-system-len", type=int, default=32)
    p.add_argument("--first-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--chat-output-len", type=int, default=16)
    p.add_argument("--setups", default="single,cache_aware,round_robin")
    p.add_argument("--skip-tp", action="store_true", help="leave out TP=1 vs TP=2 (benchmarks.tp_speed)")
    p.add_argument("--tp-new-tokens", type=int, default=32)
    p.add_argument("--tp-repeats", type=int, default=2, help="TP=1, TP=2 alternately; the best run of each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "scale_out.json")
    p.add_argument("--plot", type=Path, default=RESULTS_DIR / "scale_out.png")
    p.add_argument("--readme", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    model = bench_checkpoint(ns.model)
    words = word_list(model)
    workloads: dict[str, Any] = {
        "shared": shared_prefix_prompts(ns, words),
        "chat": chat_conversations(ns, words),
    }
    setups = [s for s in SETUPS if s.name in ns.setups.split(",")]
    n_requests = len(workloads["shared"]) + ns.convs * ns.turns
    res: dict[str, dict[str, Any]] = {}
    deployments: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="scale_out.") as tmp, \
            tqdm(total=n_requests * len(setups), desc="scale-out", unit="req") as bar:  # fmt: skip
        for setup in setups:
            res[setup.name], deployments[setup.name] = measure(setup, model, ns, workloads, Path(tmp), bar)
    tp: dict[str, Any] = {}
    if not ns.skip_tp:
        tp = tensor_parallel(ns.tp_new_tokens, ns.tp_repeats)
    met = targets(res) if len(res) == len(SETUPS) else {}
    params = {k: v for k, v in vars(ns).items() if k not in ("out", "plot", "readme")}
    write_json(ns.out, {"machine": machine_info(1), "params": params, "caveat": THROUGHPUT_CAVEAT,
                        "results": res, "deployments": deployments, "targets": met, "tp": tp})  # fmt: skip
    if res.get("single"):
        plot(res, ns.plot)
    text = dp_table(res) + f"\n\n\\* {THROUGHPUT_CAVEAT}."
    if met:
        ok = {True: "met", False: "missed"}
        text += (f"\n\n- cache_aware hit rate / single: {met['cache_aware_vs_single']:.3f} (target >= 0.95: "
                 f"{ok[met['cache_aware_within_5pct_of_single']]})\n- cache_aware / round_robin: "
                 f"{met['cache_aware_vs_round_robin']:.2f}x (target >= 2x: {ok[met['cache_aware_2x_round_robin']]})")  # fmt: skip
    if tp:
        text += "\n\nTensor parallelism (`benchmarks.tp_speed`: 88M random Llama, fp32, eager, ranks share 2 cores):\n\n"
        text += tp_table(tp)
    print(text)
    if ns.readme:
        update_readme_section("scale_out", text + "\n\n![hit rate per setup](results/scale_out.png)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
