"""Overload soak (issue 13): mixed tenants, a noisy tenant flooding, random disconnects, one worker kill.

``python -m benchmarks.soak [--duration 600] [--readme]`` runs four phases against a real server
(``radixrt.entrypoints.launch_server`` on the tiny random-weight model, a small KV pool, ``--max-queued-requests``,
``--request-timeout``, ``--tenants``), each for a quarter of ``--duration``:

- ``baseline``: the quiet tenants alone (multi-turn chat, a system prompt per tenant);
- ``no_quota``: the quiet tenants plus ``noisy`` flooding (many concurrent long distinct prompts), every
  tenant's ``kv_quota`` 1.0 (no quota in effect);
- ``quota``: the same load with quotas (quiet tenants 0.4, noisy 0.3);
- ``fault``: the ``quota`` server continues and its worker is killed (SIGKILL) once, a few seconds in.

Every request streams, so TTFT is measured at the client; a random share of requests disconnects after its
first token. Reported per phase: requests by status (200, 429, 499 = disconnected by the client, 503, other
5xx, hung = no answer within ``--hang-s``), p50 / p99 TTFT per tenant, the noisy tenant's share of the KV
pool over time (``radixrt:tenant_kv_held_tokens`` scraped once a second; PNG), worker restarts, and the
accounting invariant at idle at the end of each server (``kv_invariant_ok``, no running or queued request).

Targets: 0 hung requests, 0 5xx other than 503 during the restart window, 0 leaks, the quiet tenants' p99
TTFT with quotas <= 2x their p99 without the noisy tenant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
from benchmarks.scale_out import _port_run

ADMIN_KEY = "soak-admin"
QUIET = ("alpha", "beta")
NOISY = "noisy"
FIRST_ID, LAST_ID = 3, 8000  # random ids stay clear of the tokenizer's special tokens
START_TIMEOUT_S = 300.0
# error codes of an SSE error event -> the status a non-stream request gets for the same failure
STREAM_ERRORS = {
    "worker_unavailable": "503",
    "server_shutting_down": "503",
    "server_overloaded": "503",
    "rate_limit_exceeded": "429",
    "request_timeout": "5xx:504",
}


@dataclass(slots=True)
class Record:
    """One request as the client saw it."""

    phase: str
    tenant: str
    start: float
    status: str = "hung"  # "200", "429", "499", "503", "5xx:<code>", "4xx:<code>", "hung", "error"
    ttft: float | None = None
    e2e: float | None = None


@dataclass
class Phase:
    """What one phase collected."""

    name: str
    records: list[Record] = field(default_factory=list)
    kv_share: list[tuple[float, float]] = field(default_factory=list)  # (seconds, noisy share of the pool)
    restarts: float = 0.0
    kill_at: float | None = None


def tenants_file(path: Path, quotas: bool) -> Path:
    quiet_q, noisy_q = (0.4, 0.3) if quotas else (1.0, 1.0)
    doc = {
        "tenants": [
            *({"name": t, "api_keys": [f"key-{t}"], "kv_quota": quiet_q} for t in QUIET),
            {"name": NOISY, "api_keys": [f"key-{NOISY}"], "kv_quota": noisy_q},
        ]
    }
    path.write_text(json.dumps(doc))
    return path


@contextmanager
def serve(model: Path, ns: argparse.Namespace, tenants: Path, log: Path) -> Iterator[str]:
    """A server with the soak's settings; yields its URL, stops it with SIGTERM."""
    port = _port_run(1)
    cmd = [sys.executable, "-m", "radixrt.entrypoints.launch_server", "--model-path", str(model), "--port", str(port),
           "--max-total-tokens", str(ns.kv_tokens), "--max-queued-requests", str(ns.max_queued),
           "--request-timeout", str(ns.request_timeout), "--tenants", str(tenants),
           "--disable-compile", "--dtype", "float32", "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RADIXRT_API_KEY": ADMIN_KEY}
    url = f"http://127.0.0.1:{port}"
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    try:
        _wait_healthy(url, proc, log)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(
    url: str, proc: subprocess.Popen[bytes] | None, log: Path, timeout: float = START_TIMEOUT_S
) -> float:
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if (proc is not None and proc.poll() is not None) or time.monotonic() > t0 + timeout:
            raise RuntimeError(f"server not healthy; log tail:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)


# -- the load ----------------------------------------------------------------------------------------
async def one(client: httpx.AsyncClient, rec: Record, ids: list[int], max_new: int, disconnect: bool,
              hang_s: float) -> list[int]:  # fmt: skip
    """One streamed /generate; fills ``rec``; returns the output ids (empty unless it finished)."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    out: list[int] = []
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(hang_s):
            async with client.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    code = r.status_code
                    rec.status = str(code) if code in (429, 503) else f"{code // 100}xx:{code}"
                    return []
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[5:])
                    if "error" in data:  # a stream that fails after its start: the code names the status
                        code = str(data["error"].get("code"))
                        rec.status = STREAM_ERRORS.get(code, f"5xx:{code}")
                        return []
                    if rec.ttft is None and data["meta_info"]["completion_tokens"] > 0:
                        rec.ttft = time.perf_counter() - t0
                        if disconnect:
                            rec.status = "499"
                            return []
                    out = data["output_ids"]
        rec.status, rec.e2e = "200", time.perf_counter() - t0
        return out
    except TimeoutError:
        rec.status = "hung"
    except httpx.HTTPError as exc:
        rec.status = f"error:{type(exc).__name__}"
    return []


async def quiet_tenant(url: str, tenant: str, phase: Phase, ns: argparse.Namespace, stop: float,
                       rng: random.Random) -> None:  # fmt: skip
    """``ns.quiet_convs`` concurrent multi-turn chats under one system prompt; a new chat after
    ``ns.turns`` turns."""
    system = [rng.randrange(FIRST_ID, LAST_ID) for _ in range(ns.system_len)]
    headers = {"Authorization": f"Bearer key-{tenant}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None) as client:

        async def chat(seed: int) -> None:
            r = random.Random(seed)
            while time.monotonic() < stop:
                history = list(system)
                for _ in range(ns.turns):
                    if time.monotonic() >= stop:
                        return
                    prompt = history + [r.randrange(FIRST_ID, LAST_ID) for _ in range(ns.user_len)]
                    rec = Record(phase.name, tenant, time.monotonic())
                    phase.records.append(rec)
                    out = await one(client, rec, prompt, ns.output_len, r.random() < ns.disconnect, ns.hang_s)
                    if rec.status != "200":
                        await asyncio.sleep(0.5)
                        break  # start a new conversation
                    history = prompt + out
                    await asyncio.sleep(ns.think_s)

        await asyncio.gather(*(chat(rng.randrange(2**31)) for _ in range(ns.quiet_convs)))


async def noisy_tenant(
    url: str, phase: Phase, ns: argparse.Namespace, stop: float, rng: random.Random
) -> None:
    """``ns.noisy_concurrency`` loops of long distinct prompts, retrying a refusal after ``ns.noisy_retry_s``."""
    headers = {"Authorization": f"Bearer key-{NOISY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None) as client:

        async def loop(seed: int) -> None:
            r = random.Random(seed)
            while time.monotonic() < stop:
                prompt = [r.randrange(FIRST_ID, LAST_ID) for _ in range(ns.noisy_len)]
                rec = Record(phase.name, NOISY, time.monotonic())
                phase.records.append(rec)
                await one(client, rec, prompt, ns.output_len, r.random() < ns.disconnect, ns.hang_s)
                if rec.status != "200":
                    await asyncio.sleep(ns.noisy_retry_s)

        await asyncio.gather(*(loop(rng.randrange(2**31)) for _ in range(ns.noisy_concurrency)))


def _scrape(client: httpx.Client) -> dict[str, float]:
    """Per tenant KV tokens held, and the restart counter, from /metrics."""
    out: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("radixrt:tenant_kv_held_tokens{"):
            tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
            out[tenant] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("radixrt:worker_restarts_total"):
            out["_restarts"] = float(line.rsplit(" ", 1)[1])
    return out


async def sampler(url: str, phase: Phase, pool: int, stop: float, t0: float) -> None:
    """Once a second: the noisy tenant's share of the KV pool."""
    with admin(url) as client:
        while time.monotonic() < stop:
            try:
                m = await asyncio.to_thread(_scrape, client)
                phase.kv_share.append((time.monotonic() - t0, m.get(NOISY, 0.0) / pool))
                phase.restarts = max(phase.restarts, m.get("_restarts", 0.0))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)


async def killer(url: str, phase: Phase, at: float, t0: float) -> None:
    """SIGKILL the worker ``at`` seconds into the phase."""
    await asyncio.sleep(at)
    with admin(url) as client:
        pid = int((await asyncio.to_thread(client.get, "/server_info")).json()["worker_pid"])
    os.kill(pid, signal.SIGKILL)
    phase.kill_at = time.monotonic() - t0


async def run_phase(url: str, phase: Phase, ns: argparse.Namespace, seconds: float, noisy: bool,
                    kill_at: float | None) -> None:  # fmt: skip
    rng = random.Random(ns.seed)
    with admin(url) as client:
        pool = int(client.get("/model_info").json()["kv_total_tokens"])
    t0 = time.monotonic()
    stop = t0 + seconds
    jobs = [quiet_tenant(url, t, phase, ns, stop, rng) for t in QUIET]
    jobs.append(sampler(url, phase, pool, stop, t0))
    if noisy:
        jobs.append(noisy_tenant(url, phase, ns, stop, rng))
    if kill_at is not None:
        jobs.append(killer(url, phase, kill_at, t0))
    bar = tqdm(total=int(seconds), desc=phase.name, unit="s")

    async def tick() -> None:
        while time.monotonic() < stop:
            await asyncio.sleep(1)
            bar.update(1)

    await asyncio.gather(*jobs, tick())
    bar.close()


def idle_check(url: str, timeout: float = 120.0) -> dict[str, Any]:
    """Wait for the server to go idle, then read the accounting invariant."""
    deadline = time.monotonic() + timeout
    with admin(url) as client:
        while True:
            info = client.get("/server_info").json()
            idle = int(info.get("num_running_reqs", 1)) == 0 and int(info.get("num_queue_reqs", 1)) == 0
            if idle or time.monotonic() > deadline:
                return {"idle": idle, "kv_invariant_ok": bool(info.get("kv_invariant_ok")),
                        "kv_invariant_message": info.get("kv_invariant_message")}  # fmt: skip
            time.sleep(0.5)


# -- the report --------------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(phase: Phase) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for r in phase.records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    per_tenant: dict[str, Any] = {}
    for t in (*QUIET, NOISY):
        ttfts = [r.ttft for r in phase.records if r.tenant == t and r.ttft is not None]
        if ttfts or any(r.tenant == t for r in phase.records):
            per_tenant[t] = {"requests": sum(r.tenant == t for r in phase.records),
                             "ok": sum(r.tenant == t and r.status == "200" for r in phase.records),
                             "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p99_s": _pct(ttfts, 0.99)}  # fmt: skip
    quiet = [r.ttft for r in phase.records if r.tenant in QUIET and r.ttft is not None]
    shares = [s for _, s in phase.kv_share]
    return {
        "statuses": statuses,
        "per_tenant": per_tenant,
        "quiet_ttft_p50_s": _pct(quiet, 0.5),
        "quiet_ttft_p99_s": _pct(quiet, 0.99),
        "noisy_kv_share_max": max(shares, default=0.0),
        "noisy_kv_share_mean": sum(shares) / len(shares) if shares else 0.0,
        "restarts": phase.restarts,
        "kill_at_s": phase.kill_at,
        "kv_share": phase.kv_share,
    }


def plot(phases: dict[str, Phase], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in ("no_quota", "quota", "fault"):
        p = phases.get(name)
        if p is not None and p.kv_share:
            ax.plot([t for t, _ in p.kv_share], [s for _, s in p.kv_share], label=name)
            if p.kill_at is not None:
                ax.axvline(p.kill_at, color="red", linestyle=":", label="worker killed")
    ax.axhline(0.3, color="gray", linestyle="--", label="noisy kv_quota (quota phases)")
    ax.set_xlabel("seconds into the phase")
    ax.set_ylabel("noisy tenant's share of the KV pool")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: dict[str, Any]) -> str:
    rows = []
    for name, r in results["phases"].items():
        st = r["statuses"]
        other_5xx = sum(v for k, v in st.items() if k.startswith("5xx"))
        fmt = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
        rows.append([name, str(sum(st.values())), str(st.get("200", 0)), str(st.get("429", 0)),
                     str(st.get("499", 0)), str(st.get("503", 0)), str(other_5xx), str(st.get("hung", 0)),
                     fmt(r["quiet_ttft_p50_s"]), fmt(r["quiet_ttft_p99_s"]),
                     f"{r['noisy_kv_share_max']:.2f}", f"{r['restarts']:.0f}"])  # fmt: skip
    head = ["phase", "requests", "200", "429", "499 (client left)", "503", "other 5xx", "hung",
            "quiet TTFT p50 ms", "quiet TTFT p99 ms", "noisy KV share max", "restarts"]  # fmt: skip
    return format_table(head, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds in all (four phases)")
    p.add_argument("--kv-tokens", type=int, default=6000)
    p.add_argument("--max-queued", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--hang-s", type=float, default=180.0, help="no answer within this: hung")
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--quiet-convs", type=int, default=2, help="concurrent chats per quiet tenant")
    p.add_argument("--think-s", type=float, default=0.3)
    p.add_argument("--noisy-len", type=int, default=600)
    p.add_argument("--noisy-concurrency", type=int, default=24)
    p.add_argument("--noisy-retry-s", type=float, default=0.25,
                   help="the noisy tenant's pause after a refused request (openai-python's first backoff: 0.5)")  # fmt: skip
    p.add_argument("--disconnect", type=float, default=0.05, help="share of requests that leave early")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--readme", action="store_true", help="write the table into benchmarks/README.md")
    ns = p.parse_args(argv)
    model = bench_checkpoint("tiny")
    quarter = ns.duration / 4
    phases: dict[str, Phase] = {}
    ends: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        log = Path(tmp) / "server.log"
        for name, quotas, noisy in (("baseline", True, False), ("no_quota", False, True)):
            with serve(model, ns, tenants_file(Path(tmp) / f"{name}.json", quotas), log) as url:
                phases[name] = Phase(name)
                asyncio.run(run_phase(url, phases[name], ns, quarter, noisy, None))
                ends[name] = idle_check(url)
        with serve(model, ns, tenants_file(Path(tmp) / "quota.json", True), log) as url:
            phases["quota"] = Phase("quota")
            asyncio.run(run_phase(url, phases["quota"], ns, quarter, True, None))
            ends["quota"] = idle_check(url)
            phases["fault"] = Phase("fault")
            asyncio.run(run_phase(url, phases["fault"], ns, quarter, True, min(10.0, quarter / 3)))
            _wait_healthy(url, None, log)
            ends["fault"] = idle_check(url)
        log_tail = log.read_text(errors="replace")[-4000:]
    results: dict[str, Any] = {
        "machine": machine_info(os.cpu_count() or 1),
        "settings": vars(ns),
        "phases": {n: {**summarize(ph), "end": ends[n]} for n, ph in phases.items()},
    }
    base99 = results["phases"]["baseline"]["quiet_ttft_p99_s"]
    quota99 = results["phases"]["quota"]["quiet_ttft_p99_s"]
    results["quiet_p99_ratio_quota_vs_baseline"] = None if not base99 or quota99 is None else quota99 / base99
    results["log_tail"] = log_tail
    write_json(RESULTS_DIR / "soak.json", results)
    plot(phases, RESULTS_DIR / "soak.png")
    md = table(results)
    ratio = results["quiet_p99_ratio_quota_vs_baseline"]
    shown = "-" if ratio is None else f"{ratio:.2f}x"
    md += f"\n\nQuiet tenants' p99 TTFT with quotas / without the noisy tenant: {shown} (target <= 2x).\n"
    print(md)
    if ns.readme:
        update_readme_section("soak", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
