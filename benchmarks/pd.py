"""Prefill/decode disaggregation vs one combined server (issue 25), same total cores.

``python -m benchmarks.pd [--backend mooncake|fake] [--streams 4] [--long 6] [--long-tokens 1500]``

Setups (``OMP_NUM_THREADS`` per server; each setup gets the same total):

- ``combined``: one server, 2 threads;
- ``pd``: a prefill server (1 thread) and a decode server (1 thread) behind the real sglang-router in PD
  mode (``--pd-disaggregation``), the KV moved by ``--backend`` over TCP loopback.

Load: ``--streams`` streaming requests (short prompts, ``--stream-tokens`` greedy tokens each, EOS ignored)
start together; while they run, ``--long`` requests with ``--long-tokens``-token prompts (1 output token)
arrive every ``--long-gap`` seconds. Reported: the streams' time to first token and inter-token latency
(gaps between streamed chunks at the client) p50 / p99, the long requests' latency, the transfer counters
of the pair (tokens, bytes, seconds: bandwidth and latency per transfer and per 16-token page over TCP
loopback) and each server's cache hit rate. On a 2-core machine shared with other work, 1 + 1 threads vs 2
threads shows the interference a long prefill causes to running streams and what the split removes; it
cannot show throughput at scale (the servers, the router and the client share the same two cores).
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
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import REPO_ROOT, RESULTS_DIR, bench_checkpoint, format_table, machine_info, write_json

PAGE = 16  # tokens per "page" in the per-page transfer figures


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], threads: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def wait_http(url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not up within {timeout}s")


def server_cmd(model: Path, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "radixrt.entrypoints.launch_server", "--model-path", str(model),
            "--port", str(port), "--dtype", "float32", "--max-total-tokens", "32768", *extra]  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def stream_one(client: httpx.AsyncClient, url: str, text: str, tokens: int) -> dict[str, Any]:
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", url + "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0, "gaps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}


async def long_one(client: httpx.AsyncClient, url: str, ids: list[int], delay: float) -> float:
    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    r = await client.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    )
    r.raise_for_status()
    return time.perf_counter() - t0


async def load(url: str, args: argparse.Namespace, vocab: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    longs = [[rng.randrange(10, vocab) for _ in range(args.long_tokens)] for _ in range(args.long)]
    async with httpx.AsyncClient(timeout=600) as client:
        streams = [
            stream_one(client, url, f"Stream {i} {seed}: tell a story", args.stream_tokens)
            for i in range(args.streams)
        ]
        lat = [long_one(client, url, ids, 0.5 + i * args.long_gap) for i, ids in enumerate(longs)]
        results = await asyncio.gather(*streams, *lat)
    outs: list[dict[str, Any]] = results[: args.streams]  # type: ignore[assignment]
    gaps = [g for o in outs for g in o["gaps"]]
    ttfts = [o["ttft"] for o in outs]
    long_lat: list[float] = results[args.streams :]  # type: ignore[assignment]
    return {
        "ttft_p50_ms": 1e3 * pct(ttfts, 0.5), "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
        "itl_p50_ms": 1e3 * pct(gaps, 0.5), "itl_p99_ms": 1e3 * pct(gaps, 0.99),
        "itl_max_ms": 1e3 * max(gaps), "long_latency_p50_s": pct(long_lat, 0.5),
    }  # fmt: skip


def info(url: str) -> dict[str, float]:
    out: dict[str, float] = httpx.get(url + "/get_server_info", timeout=10).json()
    return out


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def run_combined(model: Path, args: argparse.Namespace, vocab: int, logs: Path) -> dict[str, Any]:
    port = free_port()
    procs = [start(server_cmd(model, port, []), 2, logs / "combined.log")]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        asyncio.run(load(url, args, vocab, seed=0))  # warm-up (compiles, first requests)
        out = asyncio.run(load(url, args, vocab, seed=1))
        out["hit_rate"] = info(url).get("cache_hit_rate", 0.0)
        return out
    finally:
        stop(procs)


def run_pd(model: Path, args: argparse.Namespace, vocab: int, logs: Path) -> dict[str, Any]:
    pport, dport, rport, boot = free_port(), free_port(), free_port(), free_port()
    common = ["--disaggregation-transfer-backend", args.backend]
    procs = [
        start(server_cmd(model, pport, [*common, "--disaggregation-mode", "prefill",
                                        "--disaggregation-bootstrap-port", str(boot)]), 1, logs / "prefill.log"),
        start(server_cmd(model, dport, [*common, "--disaggregation-mode", "decode"]), 1, logs / "decode.log"),
    ]  # fmt: skip
    try:
        purl, durl, rurl = (f"http://127.0.0.1:{p}" for p in (pport, dport, rport))
        wait_http(purl + "/health")
        wait_http(durl + "/health")
        router = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                  "--prefill", purl, str(boot), "--decode", durl, "--host", "127.0.0.1", "--port", str(rport),
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
        procs.append(start(router, 1, logs / "router.log"))
        wait_http(rurl + "/workers")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            workers = httpx.get(rurl + "/workers", timeout=5).json().get("workers", [])
            if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                break
            time.sleep(0.5)
        asyncio.run(load(rurl, args, vocab, seed=0))  # warm-up
        before_p, before_d = info(purl), info(durl)
        out = asyncio.run(load(rurl, args, vocab, seed=1))
        after_p, after_d = info(purl), info(durl)
        n = after_d["pd_received_transfers"] - before_d["pd_received_transfers"]
        tokens = after_p["pd_sent_tokens"] - before_p["pd_sent_tokens"]
        nbytes = after_p["pd_sent_bytes"] - before_p["pd_sent_bytes"]
        secs = after_p["pd_sent_seconds"] - before_p["pd_sent_seconds"]
        pages = max(tokens / PAGE, 1e-9)
        out.update({
            "transfers": n, "transferred_tokens": tokens, "transferred_mib": nbytes / 2**20,
            "bandwidth_mib_s": nbytes / 2**20 / secs if secs else float("nan"),
            "ms_per_transfer": 1e3 * secs / n if n else float("nan"), "us_per_page": 1e6 * secs / pages,
            "decode_computed_prompt_tokens": after_d["computed_prefill_tokens"] - before_d["computed_prefill_tokens"],
            "decode_local_prefix_tokens": after_d["pd_local_prefix_tokens"] - before_d["pd_local_prefix_tokens"],
            "prefill_hit_rate": after_p.get("cache_hit_rate", 0.0), "decode_hit_rate": after_d.get("cache_hit_rate", 0.0),
        })  # fmt: skip
        return out
    finally:
        stop(procs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny")
    p.add_argument("--backend", default="mooncake", choices=["mooncake", "fake"])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=96)
    p.add_argument("--long", type=int, default=6)
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--long-gap", type=float, default=0.4)
    args = p.parse_args()
    model = bench_checkpoint(args.size)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    logs = Path(tempfile.mkdtemp(prefix="radixrt_pd_bench_"))
    print(f"server and router logs: {logs}")
    combined = run_combined(model, args, vocab, logs)
    pd = run_pd(model, args, vocab, logs)
    keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_latency_p50_s"]
    rows = [[k, f"{combined[k]:.1f}", f"{pd[k]:.1f}"] for k in keys]
    print(format_table(["metric", "combined (2 threads)", "prefill 1 + decode 1"], rows))
    print(json.dumps({k: v for k, v in pd.items() if k not in keys}, indent=1))
    ratio = pd["itl_p99_ms"] / combined["itl_p99_ms"]
    print(f"p99 ITL ratio pd / combined: {ratio:.2f} (target <= 0.5)")
    write_json(
        RESULTS_DIR / "pd.json",
        {
            "machine": machine_info(2),
            "args": vars(args),
            "combined": combined,
            "pd": pd,
            "itl_p99_ratio": ratio,
        },
    )


if __name__ == "__main__":
    main()
