"""Device plumbing checked on CPU: what ``auto`` resolves to, the errors for GPU-only settings, and the
CUDA-graph runner's static input buffers (run without capture) against HF transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt.config.server_args import ServerArgs
from radixrt.kernels.base import get_backend_class
from radixrt.worker.cuda_graph_runner import CudaGraphRunner
from radixrt.worker.device import kv_budget_bytes, resolve_attention_backend, resolve_device, resolve_dtype
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

CPU = torch.device("cpu")
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


@needs_no_gpu
def test_auto_resolves_to_the_cpu_path() -> None:
    assert resolve_device("auto") == CPU
    assert resolve_attention_backend("auto", CPU) == "torch_native"
    assert resolve_dtype("auto", CPU) == "auto"  # the CPU's bf16 support decides later
    assert resolve_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert 0 < kv_budget_bytes(CPU, 0.01) < kv_budget_bytes(CPU, None)


@needs_no_gpu
def test_gpu_settings_without_a_gpu_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="device: 'cuda'.*no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="attention_backend 'flashinfer' needs --device cuda"):
        resolve_attention_backend("flashinfer", CPU)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton' needs --device cuda"):
        resolve_attention_backend("triton", CPU)
    with pytest.raises(ValueError, match="device: 'tpu'"):
        ServerArgs(device="tpu")
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(cuda_graph_max_bs=0)


def test_missing_flashinfer_is_a_clear_error() -> None:
    pytest.importorskip("torch")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="attention_backend 'flashinfer' is not available here"):
            get_backend_class("flashinfer")
    else:
        pytest.skip("flashinfer is installed here")


@pytest.mark.parametrize("page_size", [1, 16])
def test_static_buffer_decode_matches_hf(tiny_llama: Path, page_size: int, engine_factory) -> None:
    """Decode through the CUDA-graph runner's fixed buffers (no capture on CPU): buckets reused across
    batch sizes keep stale slot-table entries and longer index buffers, which must never be read."""
    eng = engine_factory(tiny_llama, page_size=page_size, chunked_prefill_size=16)
    runner = eng.worker.scheduler.runner
    cgr = CudaGraphRunner(
        runner.model, runner.backend, 4, runner.context_len + page_size, page_size, CPU, capture=False
    )
    calls: list[int] = []
    inner = cgr.forward

    def spy(ids, positions, md):  # type: ignore[no-untyped-def]
        calls.append(md.batch_size)
        return inner(ids, positions, md)

    cgr.forward = spy  # type: ignore[method-assign]
    runner.cuda_graph_runner = cgr
    prompts = prompts_of([30, 3, 17, 9, 41], seed=5)  # 5 requests: the first decode steps run eagerly
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (7, 12, 3, 9, 5)]
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    for ids, p, out in zip(prompts, params, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, p["max_new_tokens"])
    assert set(calls) == {1, 2, 4}  # the batch shrinks through every bucket
