"""Online serving benchmark in the style of SGLang's ``bench_serving`` (issue 4).

Run from the repo root::

    python -m benchmarks.serving                                  # server vs Engine, tiny model, 64 concurrent
    python -m benchmarks.serving --backend server --dataset random --request-rate 8
    python -m benchmarks.serving --base-url http://127.0.0.1:30000 --backend server   # a running server

Datasets (token ids, sent as ``input_ids`` so both backends see identical prompts):

- ``generated-shared-prefix``: ``--gsp-num-groups`` groups of ``--gsp-prompts-per-group`` prompts; each
  group shares a random system prompt (``--gsp-system-prompt-len``) followed by a random question
  (``--gsp-question-len``); requests are shuffled.
- ``random``: ``--num-prompts`` random prompts; lengths uniform in ``[len * (1 - range_ratio), len]``.

Arrivals: ``--request-rate inf`` sends everything at once, otherwise Poisson arrivals at that rate;
``--max-concurrency`` caps requests in flight. Every request streams (ignore_eos, fixed output
length) so TTFT and inter-token latency are measured per chunk on the client. Backends: ``server``
(HTTP ``/generate`` SSE through the ZMQ worker; launched here unless ``--base-url``) and ``engine``
(the in-process ``Engine``, same scheduler, no HTTP / ZMQ); ``both`` runs both on the same workload
and reports the server / Engine throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common import RESULTS_DIR, bench_checkpoint, machine_info, write_json
from benchmarks.serving_workload import (
    Outcome,
    Request,
    generated_shared_prefix,
    random_dataset,
    report,
    summarize,
)
from radixrt.worker.threads import compute_threads

# -- one request per backend: yields (output tokens so far, cached tokens, prompt tokens) per chunk --
Stream = Callable[[Request], AsyncIterator[tuple[int, int, int]]]


def server_stream(client: httpx.AsyncClient) -> Stream:
    async def run(req: Request) -> AsyncIterator[tuple[int, int, int]]:
        body = {
            "input_ids": req.input_ids,
            "stream": True,
            "sampling_params": {"max_new_tokens": req.output_len, "ignore_eos": True, "temperature": 0},
        }
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    raise RuntimeError(data["error"]["message"])
                meta = data["meta_info"]
                yield meta["completion_tokens"], meta["cached_tokens"], meta["prompt_tokens"]

    return run


def engine_stream(engine: Any) -> Stream:
    async def run(req: Request) -> AsyncIterator[tuple[int, int, int]]:
        params = {"max_new_tokens": req.output_len, "ignore_eos": True, "temperature": 0}
        agen = await engine.async_generate(input_ids=req.input_ids, sampling_params=params, stream=True)
        async for out in agen:
            meta = out["meta_info"]
            yield meta["completion_tokens"], meta["cached_tokens"], meta["prompt_tokens"]

    return run


async def measure(stream: Stream, req: Request) -> Outcome:
    out = Outcome(prompt_len=len(req.input_ids))
    start = last = time.perf_counter()
    try:
        async for tokens, cached, prompt in stream(req):
            now = time.perf_counter()
            if tokens > out.output_len:
                if out.output_len == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                out.output_len = tokens
            out.cached_tokens, out.prompt_len = cached, prompt
        out.e2e = time.perf_counter() - start
        out.ok = out.output_len == req.output_len
        out.error = "" if out.ok else f"got {out.output_len} of {req.output_len} tokens"
    except Exception as exc:  # recorded, counted as a failure
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def run_load(
    stream: Stream, requests: list[Request], rate: float, concurrency: int | None, seed: int, desc: str
) -> tuple[list[Outcome], float]:
    """Send ``requests`` with Poisson arrivals (or all at once); returns outcomes and the wall time."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency or len(requests))
    bar = tqdm(total=len(requests), desc=desc, leave=False)

    async def one(req: Request, delay: float) -> Outcome:
        await asyncio.sleep(delay)
        async with limit:
            res = await measure(stream, req)
        bar.update(1)
        return res

    delays, t = [], 0.0
    for _ in requests:
        delays.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    start = time.perf_counter()
    outcomes = await asyncio.gather(*[one(r, d) for r, d in zip(requests, delays, strict=True)])
    wall = time.perf_counter() - start
    bar.close()
    return list(outcomes), wall


# -- backends ------------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(
    model: Path | str, server_args: list[str], log: Path, threads: int
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "radixrt.entrypoints.launch_server", "--model-path", str(model), "--port", str(port),
           "--log-level", "warning", *server_args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # the worker process's torch threads
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            health = httpx.get(url + "/health", timeout=2)
            if health.status_code == 200:
                return proc, url
            if health.json().get("status") == "worker_down":
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    proc.wait(30)
    raise RuntimeError(f"server not ready; see {log}")


async def bench(
    model: Path, requests: list[Request], args: argparse.Namespace
) -> dict[str, list[dict[str, Any]]]:
    """Every backend ``--repeats`` times, interleaved (order rotated), each run on an empty cache."""
    import torch

    from radixrt import Engine

    backends = ["server", "engine"] if args.backend == "both" else [args.backend]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in backends}
    proc, engine, client = None, None, None
    try:
        streams: dict[str, Stream] = {}
        pids: dict[str, dict[str, int | None]] = {}
        flush: dict[str, Callable[[], Any]] = {}
        if "server" in backends:
            url = args.base_url
            if url is None:
                proc, url = launch(
                    model, args.server_args, args.output.with_suffix(".server.log"), args.threads
                )
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            client = httpx.AsyncClient(base_url=url, timeout=None, limits=limits)
            streams["server"] = server_stream(client)
            info = (await client.get("/get_server_info")).json()
            pids["server"] = {
                "worker": info["worker_pid"],
                "http": proc.pid if proc else None,
                "client": None,
            }
            flush["server"] = lambda: client.post("/flush_cache")  # type: ignore[union-attr]
        if "engine" in backends:
            engine = Engine(model_path=str(model), **_engine_kwargs(args.server_args))
            torch.set_num_threads(args.threads)
            engine.worker.call(lambda s: torch.set_num_threads(args.threads))  # the scheduler thread's pool
            streams["engine"] = engine_stream(engine)
            pids["engine"] = {"process": None}
            flush["engine"] = engine.flush_cache
        for name in backends:  # warm-up
            await measure(streams[name], Request(requests[0].input_ids[:8], 4))
        for rep in range(args.repeats):
            for name in backends[rep % len(backends) :] + backends[: rep % len(backends)]:
                done = flush[name]()
                if asyncio.iscoroutine(done):
                    await done
                cpu0 = {k: cpu_seconds(v) for k, v in pids[name].items()}
                outcomes, wall = await run_load(streams[name], requests, args.request_rate, args.max_concurrency,
                                                args.seed, f"{name} {rep + 1}/{args.repeats}")  # fmt: skip
                summary = summarize(outcomes, wall)
                summary["cpu_s"] = {k: cpu_seconds(v) - cpu0[k] for k, v in pids[name].items()}
                summary["cpu_s_per_1k_output_tokens"] = (
                    1000 * sum(summary["cpu_s"].values()) / max(summary["total_output_tokens"], 1)
                )
                runs[name].append(summary)
    finally:
        if client is not None:
            await client.aclose()
        if engine is not None:
            engine.shutdown()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return runs


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default; others via /proc, Linux only)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_kwargs(server_args: list[str]) -> dict[str, Any]:
    """The Engine twin of ``--server-args`` (parsed with the server's own CLI)."""
    from radixrt.config.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(server_args)
    defaults = ServerArgs()
    return {k: v for k, v in vars(ns).items() if v != getattr(defaults, k) and k not in ("host", "port")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["server", "engine", "both"], default="both")
    p.add_argument("--base-url", help="benchmark this running server instead of launching one")
    p.add_argument("--model-path", help="checkpoint (default: the cached random-weight bench model)")
    p.add_argument("--model-size", default="tiny", choices=["tiny", "88m"])
    p.add_argument(
        "--server-args",
        default="--max-total-tokens 131072",
        help="flags for the launched server and the Engine (one string)",
    )
    p.add_argument(
        "--dataset", choices=["generated-shared-prefix", "random"], default="generated-shared-prefix"
    )
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once"
    )
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="runs per backend (interleaved); medians reported")
    p.add_argument(
        "--threads",
        type=int,
        default=compute_threads(reserve_one=True),
        help="torch threads of the model (server worker and Engine alike; default: cores - 1)",
    )
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "serving.json")
    args = p.parse_args(argv)
    args.server_args = args.server_args.split()
    rng = random.Random(args.seed)
    data = generated_shared_prefix if args.dataset == "generated-shared-prefix" else random_dataset
    requests = data(args, rng)
    model = Path(args.model_path) if args.model_path else bench_checkpoint(args.model_size)
    results: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "machine": machine_info(args.threads), "model": str(model)}  # fmt: skip
    runs = asyncio.run(bench(model, requests, args))
    medians = {}
    for name, label in (("server", "server (HTTP + ZMQ)"), ("engine", "engine (in-process)")):
        if name in runs:
            ordered = sorted(runs[name], key=lambda r: r["output_throughput"])
            results[name] = {
                **ordered[len(ordered) // 2],
                "output_throughput_runs": [r["output_throughput"] for r in runs[name]],
            }
            medians[name] = results[name]["output_throughput"]
            print(report(f"{label}, median of {len(ordered)} runs", results[name]))
            print(f"   CPU seconds {results[name]['cpu_s']} = {results[name]['cpu_s_per_1k_output_tokens']:.2f} "
                  "s per 1k output tokens; output tok/s of each run: "
                  + ", ".join(f"{x:.0f}" for x in results[name]["output_throughput_runs"]))  # fmt: skip
    if len(medians) == 2:
        ratio = medians["server"] / medians["engine"]
        results["server_over_engine_throughput"] = ratio
        print(f"server / engine output throughput (medians): {ratio:.3f} (target >= 0.90)")
    print(f"wrote {write_json(args.output, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
