"""How much prefill work a quiet tenant's request waits behind while another tenant floods (issue 26 item 7).

``python -m benchmarks.tenant_wait [--duration 40] [--alone]`` runs the soak's tenant mix in-process (the
tiny random model, float32, a 6,000-token pool, tenants alpha / beta at ``kv_quota`` 0.4 and noisy at
0.3): two chats per quiet tenant (a 256-token system prompt, 24-token user turns, 16 tokens out, 0.3 s
between turns) and, unless ``--alone``, 24 concurrent loops of distinct 600-token noisy prompts. For every
quiet request it reports the prefill tokens the worker computed between the request's arrival and its
first token (its own included), next to the wall-clock TTFT.

The token count is what the scheduler decides; it moves far less than the soak's wall-clock TTFT when
other processes share the CPU (only through which requests meet in a round), so it compares scheduling
choices on a loaded machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, bench_checkpoint, machine_info, write_json
from radixrt import Engine
from radixrt.server.io_struct import GenerateReqInput
from radixrt.server.tokenizer_manager import RequestFailedError

QUIET = ("alpha", "beta")
FIRST_ID, LAST_ID = 3, 8000


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _tenants(path: Path) -> Path:
    quiet = [{"name": t, "api_keys": [f"key-{t}"], "kv_quota": 0.4} for t in QUIET]
    path.write_text(
        json.dumps({"tenants": [*quiet, {"name": "noisy", "api_keys": ["key-n"], "kv_quota": 0.3}]})
    )
    return path


def measure(duration: float, noisy: bool) -> dict[str, Any]:
    """Run the mix for ``duration`` seconds; the quiet requests' waits (tokens and ms) and the rounds."""
    with tempfile.TemporaryDirectory(prefix="tenant-wait-") as tmp:
        eng = Engine(model_path=str(bench_checkpoint("tiny")), max_total_tokens=6000, dtype="float32",
                     tenants=str(_tenants(Path(tmp) / "tenants.json")), disable_compile=True)  # fmt: skip
        rounds: list[tuple[float, int]] = []  # (end time, prefill tokens) of every prefill forward

        def record(s: Any) -> None:
            real = s._run_extend

            def run_extend(batch: list[Any]) -> None:
                real(batch)
                rounds.append((time.perf_counter(), sum(r.extend_len for r in batch)))

            s._run_extend = run_extend

        eng.worker.call(record, timeout=60)
        quiet: list[tuple[float, float]] = []  # (arrival, first token)
        try:
            asyncio.run_coroutine_threadsafe(_load(eng, duration, noisy, quiet), eng._loop).result()
        finally:
            eng.shutdown()
    waits = [float(sum(n for t, n in rounds if t0 < t <= t1)) for t0, t1 in quiet]
    ttfts = [(t1 - t0) * 1000 for t0, t1 in quiet]
    return {
        "noisy": noisy,
        "quiet_requests": len(quiet),
        "wait_tokens_p50": _pct(waits, 0.5),
        "wait_tokens_p99": _pct(waits, 0.99),
        "ttft_ms_p50": _pct(ttfts, 0.5),
        "ttft_ms_p99": _pct(ttfts, 0.99),
        "prefill_rounds": len(rounds),
        "mean_round_tokens": sum(n for _, n in rounds) / max(1, len(rounds)),
    }


async def _one(eng: Engine, ids: list[int], tenant: str) -> tuple[list[int] | None, float, float | None]:
    """One streamed request: (output ids or None when refused, arrival, first token time or None)."""
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    obj = GenerateReqInput(input_ids=ids, sampling_params=params, stream=True)
    t0, first = time.perf_counter(), None
    out: list[int] = []
    try:
        async for item in eng.tokenizer_manager.generate(obj, tenant=tenant):
            if first is None and item["meta_info"]["completion_tokens"] > 0:
                first = time.perf_counter()
            out = item.get("output_ids", out)
    except RequestFailedError:  # the flood meets 429s beyond its queue share
        return None, t0, None
    return list(out), t0, first


async def _load(eng: Engine, duration: float, noisy: bool, quiet: list[tuple[float, float]]) -> None:
    stop = time.perf_counter() + duration
    rng = random.Random(0)

    async def chat(tenant: str, seed: int) -> None:
        r = random.Random(seed)
        system = [r.randrange(FIRST_ID, LAST_ID) for _ in range(256)]
        while time.perf_counter() < stop:
            history = list(system)
            for _ in range(4):
                prompt = history + [r.randrange(FIRST_ID, LAST_ID) for _ in range(24)]
                out, t0, first = await _one(eng, prompt, tenant)
                if first is not None:
                    quiet.append((t0, first))
                if out is None:
                    break
                history = prompt + out
                await asyncio.sleep(0.3)

    async def flood(seed: int) -> None:
        r = random.Random(seed)
        while time.perf_counter() < stop:
            out, _, _ = await _one(eng, [r.randrange(FIRST_ID, LAST_ID) for _ in range(600)], "noisy")
            if out is None:
                await asyncio.sleep(0.25)

    jobs = [chat(t, rng.randrange(2**31)) for t in QUIET for _ in range(2)]
    if noisy:
        jobs += [flood(rng.randrange(2**31)) for _ in range(24)]
    await asyncio.gather(*jobs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tenant_wait", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=40.0, help="seconds of load")
    p.add_argument("--alone", action="store_true", help="the quiet tenants without the noisy one")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "tenant_wait.json")
    ns = p.parse_args(argv)
    settings = {"duration": ns.duration, "alone": ns.alone}
    result = {"machine": machine_info(1), "settings": settings, **measure(ns.duration, not ns.alone)}
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    write_json(ns.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
