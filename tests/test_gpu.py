"""The GPU test subset (run by scripts/gpu_check.sh on a CUDA machine; skipped elsewhere).

- FlashInfer's backend against torch_native on CUDA: extend over cached prefixes, decode, page sizes 1 and
  16, GQA 1/3/4, mixed batches, a sliding window (bf16, FlashInfer's dtype);
- the Engine on CUDA against HF transformers on the same GPU: fp32 on the Triton kernels must give
  identical greedy ids, with CUDA graphs and without; bf16 on FlashInfer reports its agreement;
- the Triton kernels themselves run compiled on the GPU in tests/test_triton_kernels.py (the same file
  runs them under Triton's interpreter on CPU in CI).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.engine_fixtures import prompts_of

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (gpu_check.sh runs these)"
)
has_flashinfer = importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(not has_flashinfer, reason="flashinfer is not installed")
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@needs_flashinfer
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize(("H", "KVH"), [(4, 4), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_flashinfer_matches_torch_native(
    mode: str, page_size: int, H: int, KVH: int, window: int | None
) -> None:
    from radixrt.kernels.flashinfer_backend import FlashInferBackend
    from tests.test_triton_kernels import BF16_TOL, DECODE_BATCH, EXTEND_BATCH, Case

    batch = EXTEND_BATCH if mode == "extend" else DECODE_BATCH
    case = Case(*batch, H, KVH, 64, page_size, dtype=torch.bfloat16, seed=H + page_size)
    case.md = case.md.to(torch.device("cuda"))
    out, _ = case.run(FlashInferBackend, window)
    ref, _ = case.reference(window)
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)


def _engine(path: Path, **kw: object):  # type: ignore[no-untyped-def]
    from radixrt import Engine

    return Engine(model_path=str(path), device="cuda", max_total_tokens=8192, cuda_graph_max_bs=8, **kw)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_fp32_on_triton_matches_hf(tiny_llama: Path, graphs: bool, page_size: int) -> None:
    from tests.hf_reference import hf_greedy

    eng = _engine(tiny_llama, dtype="float32", attention_backend="triton", page_size=page_size,
                  disable_cuda_graph=not graphs)  # fmt: skip
    try:
        prompts = prompts_of([5, 40, 17, 3, 28], seed=3)
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        for ids, out in zip(prompts, outs, strict=True):
            assert out["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
        assert (eng.worker.scheduler.runner.cuda_graph_runner is not None) == graphs
    finally:
        eng.check_invariant()
        eng.shutdown()


@needs_flashinfer
def test_engine_bf16_on_flashinfer_agrees_with_hf(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.hf_reference import hf_greedy

    eng = _engine(tiny_llama, dtype="bfloat16", attention_backend="flashinfer")
    try:
        prompts = prompts_of([5, 40, 17, 3, 28, 60, 9, 33], seed=4)
        outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        same = total = 0
        for ids, out in zip(prompts, outs, strict=True):
            ref = hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
            # Agreement up to the first divergence (after it the contexts differ).
            n = next(
                (i for i, (a, b) in enumerate(zip(out["output_ids"], ref, strict=True)) if a != b), len(ref)
            )
            same, total = same + n, total + len(ref)
        with capsys.disabled():
            print(
                f"\nbf16 FlashInfer vs fp32 HF: {same}/{total} greedy tokens agree before the first divergence"
            )
        assert same >= total // 2, "bf16 output diverges from HF almost at once: a kernel is wrong"
    finally:
        eng.check_invariant()
        eng.shutdown()
