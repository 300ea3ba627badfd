"""Where one prefill / extend forward spends its time: torch.profiler around the Engine, top ops by self CPU time.

    python -m benchmarks.profile_step                       # embedded model, defaults, 2 threads
    python -m benchmarks.profile_step --quantization none --dtype bfloat16 --top 30
    python -m benchmarks.profile_step --decode              # also one batch-1 decode step
    python -m benchmarks.profile_step --only-decode --decode-batch 16   # 32 decode steps at batch 16

Cases: a 512-token prefill (one request, nothing cached) and a 256-token extend over a 3k-token cached
prefix (the prefix is prefilled first, untimed; the extend request repeats it and appends 256 new tokens),
each generating one token. Every case runs once untimed (warm: compiled kernels, allocator) and is then
profiled; the table lists the top ops by self CPU time and a summary groups them by kind (GEMMs by kernel,
attention, the rest) against the wall time of the request, whose remainder is Python and scheduling.
"""

from __future__ import annotations  # noqa: I001 - radixrt first (below)

import radixrt  # noqa: F401 - before torch: bounds libgomp's spin-waiting (radixrt/worker/threads.py)
import argparse
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ATTENTION = "attention: backend.forward"
# op name -> summary group (first match by prefix); anything else is "other ops".
GROUPS = (
    (ATTENTION, "attention outside torch ops (C kernels, Python)"),
    ("aten::_weight_int4pack_mm", "GEMM int4 (weight-only kernel)"),
    ("aten::_weight_int8pack_mm", "GEMM int8 (weight-only kernel)"),
    ("aten::mm", "GEMM dense (oneDNN / MKL)"),
    ("aten::addmm", "GEMM dense (oneDNN / MKL)"),
    ("aten::bmm", "GEMM dense (oneDNN / MKL)"),
    ("aten::_scaled_dot_product", "attention (SDPA)"),
    ("radixrt::", "attention (the compiled graphs' custom op)"),
    ("aten::index", "gather / index (K/V gather, tables)"),
    ("aten::mul", "elementwise (norm, rotary, SiLU, residual)"),
    ("aten::add", "elementwise (norm, rotary, SiLU, residual)"),
    ("aten::silu", "elementwise (norm, rotary, SiLU, residual)"),
    ("aten::rsqrt", "elementwise (norm, rotary, SiLU, residual)"),
    ("aten::pow", "elementwise (norm, rotary, SiLU, residual)"),
    ("aten::mean", "elementwise (norm, rotary, SiLU, residual)"),
    ("aten::neg", "elementwise (norm, rotary, SiLU, residual)"),
    ("aten::cat", "copies (cat, to, copy_, contiguous)"),
    ("aten::copy_", "copies (cat, to, copy_, contiguous)"),
    ("aten::_to_copy", "copies (cat, to, copy_, contiguous)"),
    ("aten::clone", "copies (cat, to, copy_, contiguous)"),
    ("## Call CompiledFxGraph", "compiled graphs (inductor kernels)"),
    ("Torch-Compiled Region", "compiled graphs (inductor kernels)"),
    ("TorchDynamo Cache Lookup", "compiled graphs: guards, wrappers"),
    ("Pregraph bytecode", "compiled graphs: guards, wrappers"),
    ("AOTDispatcher", "compiled graphs: guards, wrappers"),
)


@contextmanager
def on_scheduler_thread(engine: Any) -> Iterator[Any]:
    """A CPU profiler started and stopped on the Engine's scheduler thread, where the model runs (torch's
    profiler records the ops of the thread that starts it)."""
    prof = profile(activities=[ProfilerActivity.CPU])
    backend = engine.worker.scheduler.runner.backend
    inner = backend.forward

    def attention(*args: Any) -> Any:
        with record_function(ATTENTION):  # C kernels called through ctypes are no torch op of their own
            return inner(*args)

    backend.forward = attention
    engine.worker.call(lambda _: prof.__enter__())
    try:
        yield prof
    finally:
        engine.worker.call(lambda _: prof.__exit__(None, None, None))
        del backend.forward


def random_ids(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def group_of(name: str) -> str:
    for prefix, group in GROUPS:
        if name.startswith(prefix):
            return group
    return "other ops"


def summarize(prof: Any, wall_s: float) -> str:
    """Self CPU time by group (ms and share of the wall time); the rest of the wall time is Python."""
    by: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        by[group_of(ev.key)] += ev.self_cpu_time_total / 1e3
    total = sum(by.values())
    lines = [f"wall {wall_s * 1e3:.1f} ms; profiled ops {total:.1f} ms (self CPU time, all threads)"]
    for group, ms in sorted(by.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {group:<45} {ms:8.1f} ms  {100 * ms / (wall_s * 1e3):5.1f}%")
    lines.append(f"  {'wall - ops (Python, scheduling, idle)':<45} {wall_s * 1e3 - total:8.1f} ms")
    lines.append("  (self times: an op's children count in their own groups)")
    return "\n".join(lines)


def fastest(
    engine: Any, prepare: Callable[[], None], request: Callable[[], Any], repeat: int
) -> tuple[Any, float, Any]:
    """Profile ``request()`` ``repeat`` times (``prepare()`` before each, unprofiled); the fastest run's
    profile, wall seconds and result (a shared machine makes single runs noisy)."""
    best: tuple[Any, float, Any] | None = None
    for _ in range(repeat):
        prepare()
        with on_scheduler_thread(engine) as prof:
            t0 = time.perf_counter()
            out = request()
            wall = time.perf_counter() - t0
        if best is None or wall < best[1]:
            best = (prof, wall, out)
    assert best is not None
    return best


def report(title: str, prof: Any, wall: float, top: int) -> None:
    print(f"\n=== {title} ===")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    print(summarize(prof, wall))


def run_case(engine: Any, name: str, prefix: list[int], ids: list[int], top: int, repeat: int) -> None:
    """One request of ``ids`` generating one token, ``prefix`` cached before it (empty: nothing cached)."""
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}

    def prepare() -> None:
        engine.flush_cache()
        if prefix:
            engine.generate(input_ids=prefix, sampling_params=params)

    prepare()
    engine.generate(input_ids=ids, sampling_params=params)  # warm-up
    prof, wall, out = fastest(
        engine, prepare, lambda: engine.generate(input_ids=ids, sampling_params=params), repeat
    )
    cached = out["meta_info"].get("cached_tokens", 0)
    new = len(ids) - cached
    report(f"{name}: {len(ids)} prompt tokens, {cached} cached, {new} computed: {wall * 1e3:.1f} ms, "
           f"{new / wall:.0f} tok/s", prof, wall, top)  # fmt: skip


def run_decode(engine: Any, top: int, repeat: int, batch: int) -> None:
    """``batch`` cached 64-token prompts generating 33 tokens together: 32 decode steps at that batch size
    after the first token."""
    vocab = engine.worker.scheduler.runner.config.vocab_size
    rng = random.Random(1)
    ids = [random_ids(64, vocab, rng) for _ in range(batch)]
    params = {"temperature": 0, "max_new_tokens": 33, "ignore_eos": True}
    engine.generate(input_ids=ids, sampling_params=params)  # warm; caches the prompts
    prof, wall, _ = fastest(
        engine, lambda: None, lambda: engine.generate(input_ids=ids, sampling_params=params), repeat
    )
    title = f"decode: 33 tokens at batch {batch} (32 decode steps): {wall * 1e3:.1f} ms"
    report(f"{title}, {wall * 1e3 / 32:.2f} ms a step", prof, wall, top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=25, help="rows of the op table")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--disable-compile", action="store_true")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--extend", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=3072)
    ap.add_argument("--decode", action="store_true", help="also profile 32 decode steps")
    ap.add_argument("--decode-batch", type=int, default=1, help="requests decoding together (--decode)")
    ap.add_argument("--only-decode", action="store_true", help="skip the prefill and extend cases")
    ap.add_argument("--repeat", type=int, default=1, help="profile each case N times, print the fastest")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="another Engine (ServerArgs) field, e.g. --set dense_gemm_min_tokens=0")  # fmt: skip
    ns = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)  # the worker reads it (radixrt/worker/threads.py)
    torch.set_num_threads(ns.threads)
    from radixrt import Engine

    kw: dict[str, Any] = {"dtype": ns.dtype, "disable_compile": ns.disable_compile}
    if ns.quantization is not None:
        kw["quantization"] = ns.quantization
    for item in ns.set:
        field, _, value = item.partition("=")
        kw[field] = int(value) if value.lstrip("-").isdigit() else value
    engine = Engine(model_path=ns.model_path, max_total_tokens=16_384, **kw)
    try:
        vocab = engine.worker.scheduler.runner.config.vocab_size
        rng = random.Random(0)
        if not ns.only_decode:
            prompt = random_ids(ns.prefill, vocab, rng)
            run_case(engine, f"prefill {ns.prefill}", [], prompt, ns.top, ns.repeat)
            prefix = random_ids(ns.prefix, vocab, rng)
            tail = random_ids(ns.extend, vocab, rng)
            run_case(engine, f"extend {ns.extend} over {ns.prefix}", prefix, prefix + tail, ns.top, ns.repeat)
        if ns.decode or ns.only_decode:
            run_decode(engine, ns.top, ns.repeat, ns.decode_batch)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
