"""The peer comparison of issue 21: radixrt (its defaults) vs OpenVINO GenAI vs llama.cpp, on the same GGUF
file with the same thread count, side by side in one process, repeated and interleaved.

Every system exposes one operation, ``run(prompts, n)``: generate ``n`` tokens (greedy, EOS ignored) for
every prompt of the list together, keeping whatever prefix cache the system has, and return the wall
seconds. The figures are built from it the same way for every system:

- ``decode_b1``: one fresh 128-token prompt with ``1 + n`` new tokens minus another with 1 (the prefill
  cancels): ``n / (t_n - t_1)``;
- ``b16_e2e`` / ``b16_decode``: 16 fresh 128-token prompts x 128 new tokens generated together:
  ``16 * 128 / t_128`` end to end, and ``16 * 127 / (t_128 - t_1)`` decode only (16 other fresh prompts
  with 1 new token give the prefill time);
- ``prefill512``: one fresh 512-token prompt, 1 new token: ``512 / t``;
- ``extend256``: a fresh 3072-token prefix is run once (1 new token), then the prefix + 256 fresh tokens,
  timed: ``256 / t`` (radixrt through its RadixCache, OpenVINO with its prefix cache warm, llama.cpp
  through its own last-sequence prefix reuse).

"Fresh" prompts are random ids drawn from one seeded generator: they never share a prefix, so no cache
helps where none should. Each repeat measures every figure on every system before the next figure (the
order of the systems rotates per repeat), with a pause between systems so the spinning worker threads
of the one before have gone to sleep; the table reports the median and the best repeat, and each
radixrt / peer ratio as the median of the per-repeat ratios (the two sides measured back to back).
"""

from __future__ import annotations

import importlib.util
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from benchmarks.llama_cpp_compat import amx_buffers_off
from benchmarks.peer_process import ProcessPeer

FIGURES = ("decode_b1", "b16_e2e", "b16_decode", "prefill512", "extend256")
HEADERS = {
    "decode_b1": "batch-1 decode",
    "b16_e2e": "16 x 128, end to end",
    "b16_decode": "16 x 128, decode only",
    "prefill512": "prefill 512",
    "extend256": "extend 256 over 3k cached",
}
RADIX = "radixrt (defaults)"
RADIX_INT8 = "radixrt --dense-gemm-int8"
RADIX_TORCH = "radixrt --int4-kernel torch"
RADIX_Q8 = "radixrt --int4-kernel q8"
SETTLE_S = 0.5  # OpenMP / TBB workers spin ~200 ms after their last parallel region
OPENVINO_SETUP = "pip install openvino-genai==2026.4.1"
LLAMA_CPP_SETUP = "pip install llama-cpp-python==0.3.36"


class Peer(Protocol):
    name: str
    max_batch: int  # 1: one sequence at a time (its batch figures are not measured)

    def run(self, prompts: list[list[int]], new_tokens: int) -> float: ...

    def flush(self) -> None: ...  # forget the cached prefixes where the system can (after each figure)

    def close(self) -> None: ...


class RadixPeer:
    """radixrt's in-process Engine with its defaults for a GGUF file (the file's own quantized blocks,
    bf16 activations where the CPU has them, compiled decode); only the KV pool is sized explicitly."""

    max_batch = 1 << 30

    def __init__(self, gguf: Path | None, kv_tokens: int = 80_000, name: str = RADIX, **flags: Any) -> None:
        from radixrt import Engine

        self.name = name
        kw: dict[str, Any] = {"max_total_tokens": kv_tokens, **flags}
        if gguf is not None:
            kw["model_path"] = str(gguf)
        self.engine = Engine(**kw)

    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        t0 = time.perf_counter()
        out = self.engine.generate(input_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
        lengths = [len(o["output_ids"]) for o in out]
        if lengths != [new_tokens] * len(prompts):
            raise RuntimeError(f"radixrt generated {lengths} tokens, asked for {new_tokens}")
        return dt

    def flush(self) -> None:
        if not self.engine.flush_cache():
            raise RuntimeError("radixrt: flush_cache refused")

    def close(self) -> None:
        self.engine.shutdown()


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python's ``Llama`` on the file: one sequence; a prompt reuses the KV of
    the longest prefix it shares with the previous sequence (what ``Llama.generate`` does). ``build_peers``
    runs it in a process of its own (``benchmarks.peer_process``: libgomp's throttling with two thread teams
    in one process)."""

    max_batch = 1

    def __init__(self, gguf: Path, threads: int, n_ctx: int = 8448) -> None:
        from llama_cpp import Llama

        amx_buffers_off()
        self.name = "llama.cpp"
        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, verbose=False)  # fmt: skip
        self.seq: list[int] = []

    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        if len(prompts) != 1:
            raise ValueError("llama.cpp's Llama runs one sequence")
        prompt = prompts[0]
        keep = 0
        while keep < min(len(prompt) - 1, len(self.seq)) and self.seq[keep] == prompt[keep]:
            keep += 1
        t0 = time.perf_counter()
        self.llm.n_tokens = keep  # eval() drops the KV from n_tokens on
        self.llm.eval(prompt[keep:])
        tok = prompt[-1]
        for _ in range(new_tokens - 1):  # the first token comes from the prompt's logits
            self.llm.eval([tok])
        dt = time.perf_counter() - t0
        self.seq = list(self.llm.input_ids[: self.llm.n_tokens])
        return dt

    def flush(self) -> None:
        self.llm.reset()
        self.seq = []

    def close(self) -> None:
        self.llm.close()


def _ids_tensor(ids: list[int]) -> Any:
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.asarray([ids], dtype=np.int64))


class OpenVINOPeer:
    """OpenVINO GenAI's ``ContinuousBatchingPipeline`` on the file (its CPU plugin's defaults: bf16
    inference precision on this CPU, u8 KV cache), prefix caching on, the prompts added together and
    ``step()``-ped until done. ``max_num_batched_tokens`` = radixrt's ``--chunked-prefill-size`` (2048)."""

    max_batch = 1 << 30

    def __init__(self, gguf: Path, threads: int, cache_gb: int = 2, max_batched_tokens: int = 2048) -> None:
        import openvino_genai as og

        self.name = "OpenVINO CB"  # the version goes into the results' "versions"
        sc = og.SchedulerConfig()
        sc.enable_prefix_caching = True
        sc.cache_size = cache_gb
        sc.max_num_batched_tokens = max_batched_tokens
        self.pipe = og.ContinuousBatchingPipeline(str(gguf), sc, "CPU", {"INFERENCE_NUM_THREADS": threads})
        self.next_id = 0

    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        cfg = self.pipe.get_config()  # the file's EOS ids; ignored below
        cfg.max_new_tokens, cfg.do_sample, cfg.ignore_eos = new_tokens, False, True
        t0 = time.perf_counter()
        handles = []
        for p in prompts:
            handles.append(self.pipe.add_request(self.next_id, _ids_tensor(p), cfg))
            self.next_id += 1
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
        dt = time.perf_counter() - t0
        lengths = [len(h.read_all()[0].generated_ids) for h in handles]
        if lengths != [new_tokens] * len(prompts):
            raise RuntimeError(f"OpenVINO generated {lengths} tokens, asked for {new_tokens}")
        return dt

    def flush(self) -> None:
        """Nothing: it has no cache flush, and fresh prompts never match what it holds."""

    def close(self) -> None:
        del self.pipe


class OpenVINOLLMPeer:
    """OpenVINO GenAI's ``LLMPipeline`` (its one-call API; on CPU it runs the same paged-attention
    pipeline underneath), one prompt per ``generate``."""

    max_batch = 1

    def __init__(self, gguf: Path, threads: int) -> None:
        import openvino_genai as og

        self.name = "OpenVINO LLMPipeline"
        self.pipe = og.LLMPipeline(str(gguf), "CPU", INFERENCE_NUM_THREADS=threads)

    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        if len(prompts) != 1:
            raise ValueError("LLMPipeline: one prompt per call here")
        cfg = self.pipe.get_generation_config()
        cfg.max_new_tokens = cfg.min_new_tokens = new_tokens
        cfg.do_sample, cfg.ignore_eos = False, True
        t0 = time.perf_counter()
        out = self.pipe.generate(_ids_tensor(prompts[0]), cfg)
        dt = time.perf_counter() - t0
        if len(out.tokens[0]) != new_tokens:
            raise RuntimeError(f"LLMPipeline generated {len(out.tokens[0])} tokens, asked for {new_tokens}")
        return dt

    def flush(self) -> None:
        """Nothing to flush between figures (fresh prompts)."""

    def close(self) -> None:
        del self.pipe


def missing(module: str, setup: str) -> str | None:
    """Why a benchmark-only peer cannot run here (None when its module is importable)."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (a benchmark-only dependency: `{setup}`)"
    return None


def build_peers(
    gguf: Path, threads: int, names: list[str], log: Callable[[str], None] = print
) -> tuple[list[Any], dict[str, Any]]:
    """The peers of ``names`` (radixrt, radixrt-int8, radixrt-torch (torch's weight-only kernels: in float32 the
    dense weights), radixrt-q8 (int8 activations in float32), openvino, openvino-llm, llama.cpp) that can run here; and
    ``{"skipped": {name: why}, "startup_s": {system: seconds}}``. radixrt loads the embedded model
    through its default path when ``gguf`` is that file (the same file either way)."""
    from radixrt.models.embedded import embedded_gguf_path

    makers: dict[str, tuple[str | None, Callable[[], Any]]] = {
        "radixrt": (None, lambda: RadixPeer(None if gguf == embedded_gguf_path() else gguf)),
        "radixrt-int8": (
            None,
            lambda: RadixPeer(
                None if gguf == embedded_gguf_path() else gguf, name=RADIX_INT8, dense_gemm_int8=True
            ),
        ),
        "radixrt-torch": (
            None,
            lambda: RadixPeer(
                None if gguf == embedded_gguf_path() else gguf, name=RADIX_TORCH, int4_kernel="torch"
            ),
        ),
        "radixrt-q8": (
            None,
            lambda: RadixPeer(
                None if gguf == embedded_gguf_path() else gguf, name=RADIX_Q8, int4_kernel="q8"
            ),
        ),
        "openvino": (missing("openvino_genai", OPENVINO_SETUP), lambda: OpenVINOPeer(gguf, threads)),
        "openvino-llm": (missing("openvino_genai", OPENVINO_SETUP), lambda: OpenVINOLLMPeer(gguf, threads)),
        "llama.cpp": (
            missing("llama_cpp", LLAMA_CPP_SETUP),
            lambda: ProcessPeer(LlamaCppPeer, gguf, threads),
        ),
    }
    peers: list[Any] = []
    skipped: dict[str, str] = {}
    startup: dict[str, float] = {}
    for name in names:
        if name not in makers:
            raise ValueError(f"unknown peer {name!r} (one of {', '.join(makers)})")
        why, make = makers[name]
        if why is not None:
            log(f"{name}: skipped: {why}")
            skipped[name] = why
            continue
        t0 = time.perf_counter()
        try:
            peer = make()
        except RuntimeError as exc:  # e.g. OpenVINO GenAI on a GGUF tensor type it does not read
            why = f"could not load {gguf.name}: {type(exc).__name__}: {str(exc).strip()}"
            log(f"{name}: skipped: {why}")
            skipped[name] = why
            continue
        startup[peer.name] = time.perf_counter() - t0
        peers.append(peer)
    return peers, {"skipped": skipped, "startup_s": startup, "versions": versions(peers)}


def versions(peers: list[Any]) -> dict[str, str]:
    """The version of each system's package."""
    from importlib.metadata import version

    dist = {RADIX: "radixrt", RADIX_INT8: "radixrt", RADIX_TORCH: "radixrt", RADIX_Q8: "radixrt", "OpenVINO CB": "openvino-genai", "OpenVINO LLMPipeline": "openvino-genai",
            "llama.cpp": "llama-cpp-python"}  # fmt: skip
    return {p.name: version(dist[p.name]) for p in peers}


def _fresh(rng: random.Random, vocab: int, batch: int, length: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


def measure_figure(peer: Peer, figure: str, rng: random.Random, vocab: int) -> float | None:
    """One value of ``figure`` (tok/s) on ``peer``; None where the peer runs one sequence only."""
    fresh: Callable[[int, int], list[list[int]]] = lambda b, n: _fresh(rng, vocab, b, n)  # noqa: E731
    if figure.startswith("b16") and peer.max_batch < 16:
        return None
    if figure == "decode_b1":
        t1 = peer.run(fresh(1, 128), 1)
        tn = peer.run(fresh(1, 128), 129)
        value = 128 / (tn - t1)
    elif figure == "b16_e2e":
        value = 16 * 128 / peer.run(fresh(16, 128), 128)
    elif figure == "b16_decode":
        t1 = peer.run(fresh(16, 128), 1)
        tn = peer.run(fresh(16, 128), 128)
        value = 16 * 127 / (tn - t1)
    elif figure == "prefill512":
        value = 512 / peer.run(fresh(1, 512), 1)
    elif figure == "extend256":
        prefix = fresh(1, 3072)[0]
        peer.run([prefix], 1)
        value = 256 / peer.run([prefix + fresh(1, 256)[0]], 1)
    else:
        raise ValueError(f"unknown figure {figure!r}")
    peer.flush()
    return value


def _busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has been busy since boot (Linux ``/proc/stat``; None elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def gguf_vocab_size(gguf: Path) -> int:
    """Tokens in the file's vocabulary (the prompts are random ids below it)."""
    from gguf import GGUFReader

    return len(GGUFReader(str(gguf)).fields["tokenizer.ggml.tokens"].data)


def run_peers(
    peers: list[Any], vocab: int, repeats: int, seed: int = 0, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Every figure on every peer: one untimed warm-up pass, then ``repeats`` interleaved repeats."""
    rng = random.Random(seed)
    for p in peers:
        t0 = time.perf_counter()
        for fig in FIGURES:
            measure_figure(p, fig, rng, vocab)
        log(f"warm-up of {p.name}: {time.perf_counter() - t0:.0f} s")
    values: dict[str, dict[str, list[float | None]]] = {p.name: {f: [] for f in FIGURES} for p in peers}
    others: list[float | None] = []  # cores other processes kept busy during each repeat
    for rep in range(repeats):
        order = peers[rep % len(peers) :] + peers[: rep % len(peers)]
        busy0, own0, t0 = _busy_cpu_s(), time.process_time(), time.perf_counter()
        for fig in FIGURES:
            for p in order:
                time.sleep(SETTLE_S)
                values[p.name][fig].append(measure_figure(p, fig, rng, vocab))
        busy1, own1, wall = _busy_cpu_s(), time.process_time(), time.perf_counter() - t0
        others.append(
            None if busy0 is None or busy1 is None else max(0.0, busy1 - busy0 - (own1 - own0)) / wall
        )
        log(f"repeat {rep + 1}/{repeats} (other processes: {_fmt_cores(others[-1])} cores): " + "; ".join(
            f"{p.name} " + " ".join(_fmt(values[p.name][f][-1]) for f in FIGURES) for p in peers))  # fmt: skip
    return {"figures": list(FIGURES), "repeats": repeats, "values": values, "other_cores": others,
            "summary": summarize(values)}  # fmt: skip


def summarize(values: dict[str, dict[str, list[float | None]]]) -> dict[str, Any]:
    """Per system and figure: median and best; per peer and figure: median of the per-repeat ratios
    radixrt / peer."""
    out: dict[str, Any] = {"systems": {}, "ratios": {}}
    for name, figs in values.items():
        out["systems"][name] = {}
        for fig, vals in figs.items():
            got = [v for v in vals if v is not None]
            out["systems"][name][fig] = {"median": statistics.median(got), "best": max(got)} if got else None
    rx = values.get(RADIX)
    for name, figs in values.items():
        if rx is None or name == RADIX:
            continue
        out["ratios"][name] = {}
        for fig in FIGURES:
            pairs = [a / b for a, b in zip(rx[fig], figs[fig], strict=True) if a is not None and b]
            out["ratios"][name][fig] = statistics.median(pairs) if pairs else None
    return out


def _fmt_cores(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def table(result: dict[str, Any]) -> str:
    """Markdown: tok/s per system (median, best in brackets), then radixrt / each peer."""
    from benchmarks.common import format_table

    s, ratios = result["summary"]["systems"], result["summary"]["ratios"]
    head = ["system", *[f"{HEADERS[f]} tok/s" for f in FIGURES]]
    rows = []
    for name, figs in s.items():
        cells = []
        for f in FIGURES:
            v = figs[f]
            cells.append("one sequence" if v is None else f"{_fmt(v['median'])} ({_fmt(v['best'])})")
        rows.append([name, *cells])
    for name, figs in ratios.items():
        rows.append([f"radixrt / {name}"] + ["" if figs[f] is None else f"{figs[f]:.2f}x" for f in FIGURES])
    return format_table(head, rows)
