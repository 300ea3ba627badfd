"""The Triton attention backend (radixrt/kernels/triton_backend.py, radixrt/kernels/triton/) against torch_native.

Without CUDA the kernels run on CPU tensors under Triton's interpreter, which Triton picks when a
function is decorated with ``@triton.jit`` -- its own library (``tl.zeros``, ``tl.max``) included, at
``import triton``. So TRITON_INTERPRET=1 is set here when this module is the first to import triton
(running this file alone). In a larger session some earlier module usually has imported triton already
(torch's inductor does); then the kernel tests skip in this process and ``test_kernels_in_fresh_process``
runs this file again in a subprocess with TRITON_INTERPRET=1. The variable is never set for a process
that already imported triton, and never with CUDA, where the same tests run the compiled kernels.

Every case builds its batch metadata with the model runner's own ``build_metadata`` over a shuffled
page-major slot layout, fills a two-layer pool with random K/V, runs the same layer through
``TorchNativeBackend(use_decode_kernel=False)`` and ``TritonBackend`` and compares outputs and the pools
(float32 tolerances tight enough to fail on an off-by-one mask). The interpreter is slow: tiny shapes,
16-wide tiles, so tile and split boundaries fall inside the requests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Whether the kernels can run in this process (compiled on CUDA, or interpreted on CPU).
IN_PROCESS = DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

from radixrt.kernels import triton_backend  # noqa: E402
from radixrt.kernels.base import AttentionMetadata, ForwardMode, get_backend_class  # noqa: E402
from radixrt.kernels.torch_native import TorchNativeBackend  # noqa: E402
from radixrt.kernels.triton import KVIndex, alloc_decode_workspace, decode_attention_fwd, extend_attention_fwd  # noqa: E402
from radixrt.mem_cache.kv_pool import KVPool  # noqa: E402
from radixrt.worker.model_runner import ForwardInput, ModelRunner  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
runs_kernels = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton was imported before TRITON_INTERPRET=1 could be set: test_kernels_in_fresh_process runs this",
)

F32_TOL: dict[str, Any] = dict(rtol=2e-5, atol=2e-6)
BF16_TOL: dict[str, Any] = dict(rtol=2e-2, atol=2e-2)  # p is rounded to bf16 before p @ v, as on a GPU
BF16_MEAN_ERR = 4e-3  # measured 0.6e-3 to 1.6e-3 on these cases
LAYER = 1  # the pool has two layers; layer 0 holds other values, so a wrong layer_id shows


class Case:
    """One batch: metadata from ModelRunner.build_metadata, a two-layer pool, this layer's q/k/v."""

    def __init__(
        self,
        prefix_lens: list[int],
        extend_lens: list[int],
        H: int,
        KVH: int,
        D: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        q_scale: float = 1.0,
        padding_row: bool = False,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        B = len(prefix_lens)
        seq = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        pages = [-(-s // page_size) for s in seq]
        num_pages = sum(pages) + 3  # page 0 is the reserved padding page
        order = torch.randperm(num_pages - 1, generator=g) + 1
        req_to_token = torch.zeros(B + 1, max(seq) + page_size, dtype=torch.int64)
        used = 0
        for b in range(B):
            if padding_row and b == B - 1:
                continue  # row of zeros: reads and writes only slot 0, like the graph runner's padding
            ids = order[used : used + pages[b]]
            used += pages[b]
            slots = (ids[:, None] * page_size + torch.arange(page_size)).flatten()
            req_to_token[b + 1, : len(slots)] = slots
        runner = SimpleNamespace(
            device=DEVICE,
            args=SimpleNamespace(page_size=page_size),
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token.to(DEVICE)),
        )
        mode = ForwardMode.DECODE if max(extend_lens) == 1 else ForwardMode.EXTEND
        fi = ForwardInput(mode, list(range(1, B + 1)), prefix_lens, extend_lens, [], torch.zeros(0))
        self.md: AttentionMetadata = ModelRunner.build_metadata(runner, fi)  # type: ignore[arg-type]
        self.num_slots = num_pages * page_size
        self.shape = (H, KVH, D)
        self.dtype = dtype
        T = sum(extend_lens)
        kv_shape = (2, self.num_slots, KVH, D)
        self.init_k = torch.randn(kv_shape, generator=g).to(dtype)
        self.init_v = torch.randn(kv_shape, generator=g).to(dtype)
        self.q = (torch.randn(T, H, D, generator=g) * q_scale).to(dtype)
        self.k = torch.randn(T, KVH, D, generator=g).to(dtype)
        self.v = torch.randn(T, KVH, D, generator=g).to(dtype)

    def pool(self, dtype: torch.dtype | None = None) -> KVPool:
        dtype = dtype or self.dtype
        H, KVH, D = self.shape
        pool = KVPool(self.num_slots, 2, KVH, D, dtype, DEVICE)
        for layer in range(2):
            pool.k_buffers[layer].copy_(self.init_k[layer])
            pool.v_buffers[layer].copy_(self.init_v[layer])
        return pool

    def run(
        self, backend_cls: type, window: int | None, dtype: torch.dtype | None = None, **kw: object
    ) -> tuple[torch.Tensor, KVPool]:
        """(output, pool) of one layer forward; ``dtype`` casts everything (float32 for references)."""
        dtype = dtype or self.dtype
        H, KVH, D = self.shape
        pool = self.pool(dtype)
        backend = backend_cls(pool, H, KVH, D, D**-0.5, window, **kw)
        backend.init_forward_metadata(self.md)
        q, k, v = (t.to(DEVICE, dtype) for t in (self.q, self.k, self.v))
        return backend.forward(q, k, v, LAYER, self.md), pool

    def reference(self, window: int | None) -> tuple[torch.Tensor, KVPool]:
        """torch_native's float32 result on the same (possibly bf16-rounded) inputs."""
        return self.run(TorchNativeBackend, window, torch.float32, use_decode_kernel=False)


def triton_kw(**kw: object) -> dict[str, Any]:
    return {"block_m": 16, "block_n": 16, "max_kv_splits": 4, "min_split_len": 16, **kw}


def check(case: Case, window: int | None, **kw: object) -> torch.Tensor:
    """Run Triton against the reference; returns the Triton output."""
    out, pool = case.run(triton_backend.TritonBackend, window, **triton_kw(**kw))
    ref, ref_pool = case.reference(window)
    assert out.shape == ref.shape and out.dtype == case.dtype
    tol = F32_TOL if case.dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.float(), ref, **tol)
    if case.dtype != torch.float32:
        assert (out.float() - ref).abs().mean() < BF16_MEAN_ERR
    for mine, theirs in ((pool.k_buffers, ref_pool.k_buffers), (pool.v_buffers, ref_pool.v_buffers)):
        for layer in range(2):
            assert torch.equal(mine[layer].float(), theirs[layer])
    if window is not None:  # the window must have mattered, or the case tests nothing
        no_window, _ = case.reference(None)
        assert (no_window - ref).abs().max() > 1e-2
    return out


GQA = [(4, 4), (6, 2), (8, 2)]
GQA_IDS = ["gqa1", "gqa3", "gqa4"]
# Mixed batch: prefix 0 and long prefixes, extends across several 16-token tiles and of one token.
EXTEND_BATCH = ([0, 37, 0, 70], [5, 20, 33, 1])
DECODE_BATCH = ([0, 16, 63, 99, 150], [1, 1, 1, 1, 1])


@runs_kernels
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize(("H", "KVH"), GQA, ids=GQA_IDS)
@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
def test_extend(page_size: int, H: int, KVH: int, window: int | None) -> None:
    check(Case(*EXTEND_BATCH, H, KVH, 32, page_size, seed=H + page_size), window)


@runs_kernels
@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
@pytest.mark.parametrize(("H", "KVH"), GQA, ids=GQA_IDS)
@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
def test_decode_split_k(page_size: int, H: int, KVH: int, window: int | None) -> None:
    """At most 4 splits of >= 16 positions: 1, 2, 4, 4, 4 splits for these lengths (1 or 2 windowed)."""
    check(Case(*DECODE_BATCH, H, KVH, 32, page_size, seed=H * page_size), window)


@runs_kernels
@pytest.mark.parametrize("mode", ["extend", "decode"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
def test_bf16(mode: str, window: int | None) -> None:
    batch = EXTEND_BATCH if mode == "extend" else DECODE_BATCH
    check(Case(*batch, 6, 2, 32, 16, dtype=torch.bfloat16, seed=5), window)


@runs_kernels
def test_odd_head_dim_wide_group_sharp_softmax() -> None:
    """D=24 (masked lanes of a 32-wide tile), 5 query heads per kv head, large scores."""
    check(Case(*EXTEND_BATCH, 10, 2, 24, 16, q_scale=6.0, seed=3), 5)
    check(Case(*DECODE_BATCH, 10, 2, 24, 16, q_scale=6.0, seed=4), None)


@runs_kernels
def test_decode_group_of_32_and_padding_row() -> None:
    """32 query heads on one kv head (a 32-row head block); the last row is graph-runner padding."""
    check(Case([40, 0, 7], [1, 1, 1], 32, 1, 16, 1, padding_row=True, seed=6), None)


@runs_kernels
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_slot_table_index_and_no_split(mode: str) -> None:
    """The slot-table path equals the page-table path; one split (no merge kernel) equals four."""
    batch = EXTEND_BATCH if mode == "extend" else DECODE_BATCH
    case = Case(*batch, 6, 2, 32, 16, seed=11)
    paged = check(case, 9)
    tol: dict[str, Any] = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(check(case, 9, use_slot_table=True), paged, **tol)
    torch.testing.assert_close(check(case, 9, max_kv_splits=1), paged, **tol)


@runs_kernels
def test_decode_kernel_static_buffers_and_empty_request() -> None:
    """out= and a larger workspace (what a captured graph passes) are used as given; seq_len 0 -> zeros."""
    case = Case([30, 5, 0], [1, 1, 1], 6, 2, 32, 16, seed=2)
    md = case.md
    pool = case.pool()
    k_buf, v_buf = pool.get_kv_buffer(0)
    index = KVIndex.pages(md.kv_indptr, md.kv_indices, md.page_size)
    q = case.q.to(DEVICE)
    lens = md.seq_lens.clone()
    lens[1] = 0
    out = torch.full_like(q, float("nan"))
    ws = alloc_decode_workspace(8, 6, 32, 4, DEVICE)
    got = decode_attention_fwd(
        q,
        k_buf,
        v_buf,
        index,
        lens,
        0.2,
        max_kv_splits=4,
        min_split_len=16,
        out=out,
        workspace=ws,
        block_n=16,
    )
    assert got is out
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    fresh = decode_attention_fwd(
        q, k_buf, v_buf, index, lens, 0.2, max_kv_splits=4, min_split_len=16, block_n=16
    )
    torch.testing.assert_close(out, fresh, rtol=0, atol=0)


def test_bad_arguments_raise_value_error() -> None:
    case = Case([3], [1], 6, 2, 32, 1)
    k_buf, v_buf = case.pool().get_kv_buffer(0)
    index = KVIndex.pages(case.md.kv_indptr, case.md.kv_indices, 1)
    q = case.q.to(DEVICE)
    lens = case.md.seq_lens
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention_fwd(q[:, :5], k_buf, v_buf, index, lens, 1.0)
    with pytest.raises(ValueError, match="v_buf"):
        decode_attention_fwd(q, k_buf, v_buf.to(torch.bfloat16), index, lens, 1.0)
    with pytest.raises(ValueError, match="workspace"):
        decode_attention_fwd(
            q, k_buf, v_buf, index, lens, 1.0, workspace=alloc_decode_workspace(1, 6, 32, 2, DEVICE)
        )
    with pytest.raises(ValueError, match="block sizes"):
        extend_attention_fwd(
            q, k_buf, v_buf, index, case.md.qo_indptr, case.md.prefix_lens, 1, 1.0, block_m=24
        )
    with pytest.raises(ValueError, match="page_size"):
        KVIndex.pages(case.md.kv_indptr, case.md.kv_indices, 0)


def test_missing_triton_is_a_clear_registry_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name in ("radixrt.kernels.triton", "radixrt.kernels.triton_backend") or name.startswith(
            "radixrt.kernels.triton."
        ):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    with pytest.raises(ValueError, match=r"attention_backend 'triton' is not available here: .*triton"):
        get_backend_class("triton")


def test_registry_finds_the_backend_and_base_does_not_import_triton() -> None:
    assert get_backend_class("triton") is triton_backend.TritonBackend
    code = "import sys, radixrt.kernels.base, radixrt.kernels.torch_native; assert 'triton' not in sys.modules, 'triton'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests ran in this process")
def test_kernels_in_fresh_process() -> None:
    """This file again in a process where this module imports triton first, under the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed, 1 skipped in " in summary, proc.stdout[-2000:]  # skipped: only this test
