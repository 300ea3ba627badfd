"""How much prefill work a quiet tenant's request waits behind while another tenant floods (issue 26 item 7).

``python -m benchmarks.tenant_wait [--duration 40] [--alone]`` runs the soak's tenant mix in-process (the
tiny random model, float32, a 6,000-token pool, tenants alpha / beta at ``kv_quota`` 0.4 and noisy at
0.3): two chats per quiet tenant (a 256-token system prompt, 24-token user turns, 16 tokens out, 0.3 s
between turns) and, unless ``--alone``, 24 concurrent loops of distinct 600-token noisy prompts. For every
quiet request it reports the prefill tokens the worker computed from the forward in flight at the
request's arrival through the round of its first token (its own included), next to the wall-clock TTFT, and
where the wait went: that forward in flight, forwards before the request's own round, the other tenants'
tokens in its own round (means over all quiet requests and over the slowest tenth; the slowest five's
rounds listed).

The token count is what the scheduler decides; it moves far less than the soak's wall-clock TTFT when
other processes share the CPU (only through which requests meet in a round), so it compares scheduling
choices on a loaded machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(slots=True)
class Round:
    """One forward of the worker: prefill (``reqs``: rid -> tenant, tokens, prefill finished) or decode."""

    start: float
    end: float
    kind: str  # "prefill" | "decode"
    reqs: dict[str, tuple[str | None, int, bool]]
    decoding: int  # rows decoded in it (a decode step's batch; mixed-chunk rows of a prefill)

    @property
    def tokens(self) -> int:
        return sum(n for _, n, _ in self.reqs.values())


def _record(rounds: list[Round]) -> Callable[[Any], None]:
    """A worker-thread patch of the scheduler that appends every forward to ``rounds``."""

    def patch(s: Any) -> None:
        real_extend, real_decode = s._run_extend, s._run_decode

        def run_extend(batch: list[Any], decoding: list[Any]) -> None:
            t0 = time.perf_counter()
            real_extend(batch, decoding)
            reqs = {r.rid: (r.tenant, r.extend_len, r.prefill_done) for r in batch}
            rounds.append(Round(t0, time.perf_counter(), "prefill", reqs, len(decoding)))

        def run_decode() -> None:
            t0, n = time.perf_counter(), len(s.running)
            real_decode()
            rounds.append(Round(t0, time.perf_counter(), "decode", {}, n))

        s._run_extend, s._run_decode = run_extend, run_decode

    return patch


def breakdown(rid: str, t0: float, t1: float, rounds: list[Round]) -> dict[str, float]:
    """Where one quiet request's wait went: the forward in flight when it arrived (its remaining ms, all
    its tokens), the forwards that ran after it arrived and before its own first prefill round (tokens,
    count), its own rounds (its tokens, other tenants' tokens, ms) and the rest to the client's first
    token (ms: output processing, streaming)."""
    # NOTE: the first token reaches the client inside the round's forward call (before ``Round.end``).
    mine = [r for r in rounds if rid in r.reqs and r.start < t1 and r.end > t0]
    first = mine[0].start if mine else t1
    last = mine[-1].start if mine else t1
    inflight = [r for r in rounds if r.start < t0 < r.end]
    between = [r for r in rounds if t0 <= r.start < first]
    own = sum(r.reqs[rid][1] for r in mine)
    return {
        "inflight_ms": sum(r.end - t0 for r in inflight) * 1000,
        "inflight_tokens": sum(r.tokens for r in inflight),
        "between_rounds": len(between),
        "between_prefill_tokens": sum(r.tokens for r in between),
        "between_decode_steps": sum(r.kind == "decode" for r in between),
        "between_ms": (first - max([t0, *(r.end for r in inflight)])) * 1000,
        "own_rounds": len(mine),
        "own_tokens": own,
        "own_round_other_tokens": sum(r.tokens for r in mine) - own,
        "own_ms": sum(r.end - r.start for r in mine) * 1000,
        "after_ms": (t1 - (mine[-1].end if mine else t1)) * 1000,
        # the worker's side: from the forward in flight at arrival through the round of its first token
        # (the client may read that token only after the next round started, on a loaded machine)
        "wait_tokens": float(sum(r.tokens for r in rounds if r.end > t0 and r.start <= last)),
        "ttft_ms": (t1 - t0) * 1000,
    }


def _window(t0: float, t1: float, rounds: list[Round]) -> list[str]:
    """The forwards overlapping (t0, t1), one line each: kind, ms, tokens per request."""
    return [
        f"{r.kind} {(r.end - r.start) * 1000:.0f}ms decode_rows={r.decoding} "
        + " ".join(f"{rid}:{n}{'' if done else '+'}" for rid, (_, n, done) in r.reqs.items())
        for r in rounds
        if r.start < t1 and r.end > t0
    ]


def measure(duration: float, noisy: bool) -> dict[str, Any]:
    """Run the mix for ``duration`` seconds; the quiet requests' waits (tokens and ms) and the rounds."""
    with tempfile.TemporaryDirectory(prefix="tenant-wait-") as tmp:
        eng = Engine(model_path=str(bench_checkpoint("tiny")), max_total_tokens=6000, dtype="float32",
                     tenants=str(_tenants(Path(tmp) / "tenants.json")), disable_compile=True)  # fmt: skip
        rounds: list[Round] = []
        eng.worker.call(_record(rounds), timeout=60)
        quiet: list[tuple[str, float, float]] = []  # (rid, arrival, first token)
        try:
            asyncio.run_coroutine_threadsafe(_load(eng, duration, noisy, quiet), eng._loop).result()
        finally:
            eng.shutdown()
    rows = [breakdown(rid, t0, t1, rounds) for rid, t0, t1 in quiet]
    prefills = [r for r in rounds if r.kind == "prefill"]
    out: dict[str, Any] = {"noisy": noisy, "quiet_requests": len(quiet)}
    for key in ("wait_tokens", "ttft_ms"):
        for q in (50, 90, 99):
            out[f"{key}_p{q}"] = _pct([r[key] for r in rows], q / 100)
    out.update(prefill_rounds=len(prefills), decode_steps=len(rounds) - len(prefills),
               mean_round_tokens=sum(r.tokens for r in prefills) / max(1, len(prefills)))  # fmt: skip
    # the slowest tenth of quiet requests (by TTFT): the mean of each part of their wait
    tail = sorted(rows, key=lambda r: r["ttft_ms"])[-max(1, len(rows) // 10) :]
    out["tail_breakdown_mean"] = {k: statistics.fmean(r[k] for r in tail) for k in rows[0]} if rows else {}
    out["all_breakdown_mean"] = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]} if rows else {}
    slowest = sorted(zip(rows, quiet, strict=True), key=lambda x: -x[0]["wait_tokens"])[:5]
    out["slowest_by_tokens"] = [
        {**row, "rid": rid, "rounds": _window(t0, t1, rounds)} for row, (rid, t0, t1) in slowest
    ]
    return out


async def _one(
    eng: Engine, ids: list[int], tenant: str, rid: str
) -> tuple[list[int] | None, float, float | None]:
    """One streamed request: (output ids or None when refused, arrival, first token time or None)."""
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    obj = GenerateReqInput(input_ids=ids, sampling_params=params, stream=True, rid=rid)
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


async def _load(eng: Engine, duration: float, noisy: bool, quiet: list[tuple[str, float, float]]) -> None:
    stop = time.perf_counter() + duration
    rng = random.Random(0)
    rids = itertools.count()

    async def chat(tenant: str, seed: int) -> None:
        r = random.Random(seed)
        system = [r.randrange(FIRST_ID, LAST_ID) for _ in range(256)]
        while time.perf_counter() < stop:
            history = list(system)
            for _ in range(4):
                prompt = history + [r.randrange(FIRST_ID, LAST_ID) for _ in range(24)]
                rid = f"{tenant}-{next(rids)}"
                out, t0, first = await _one(eng, prompt, tenant, rid)
                if first is not None:
                    quiet.append((rid, t0, first))
                if out is None:
                    break
                history = prompt + out
                await asyncio.sleep(0.3)

    async def flood(seed: int) -> None:
        r = random.Random(seed)
        while time.perf_counter() < stop:
            ids = [r.randrange(FIRST_ID, LAST_ID) for _ in range(600)]
            out, _, _ = await _one(eng, ids, "noisy", f"noisy-{next(rids)}")
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
    result["load_avg_end"] = os.getloadavg()
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    write_json(ns.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
