"""Compiled graphs called directly (radixrt.worker.direct_call): a graph bound from one module's call gives
another module of the same kind that module's output; what cannot be placed stays on dynamo; an Engine's
decode steps run the bound graphs (per layer and whole stack) and still give transformers' greedy ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixrt.worker import direct_call
from radixrt.worker.direct_call import BoundCall, CapturingInductor, bind
from radixrt.worker.graph_runner import fresh_function
from tests.engine_fixtures import prompts_of
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SCALE = torch.tensor([2.0, 3.0, 4.0, 5.0])


class _Block(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g))
        self.register_buffer("shift", torch.randn(4, generator=g))
        self.table = torch.randn(4, generator=g)  # a plain tensor attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x) + self.shift) * self.table


def _step(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)  # type: ignore[no-any-return]


def _step_with_global(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x) * SCALE  # type: ignore[no-any-return]


def _compiled(fn: Any, name: str) -> tuple[Any, CapturingInductor]:
    capture = CapturingInductor({})
    opts = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    return torch.compile(fresh_function(fn, name), backend=capture, fullgraph=True, options=opts), capture


def test_a_bound_graph_runs_another_module_of_its_kind() -> None:
    a, b = _Block(1), _Block(2)
    fn, capture = _compiled(_step, "_direct_test_step")
    x = torch.randn(3, 4)
    with torch.inference_mode():
        assert torch.allclose(fn(a, x), a(x), atol=1e-6)
        direct = bind(capture, {"x": x}, {"block": a})
        assert isinstance(direct, direct_call.DirectCall)
        assert ("input", "x") in direct.slots
        assert {s[2] for s in direct.slots if s[0] == "tensor"} >= {"lin.weight", "shift", "table"}
        y = torch.randn(3, 4)
        assert torch.allclose(BoundCall(direct, {"block": b})(x=y), b(y), atol=1e-6)
        assert torch.allclose(BoundCall(direct, {"block": a})(x=y), a(y), atol=1e-6)


def test_a_tensor_outside_the_modules_keeps_the_dynamo_path() -> None:
    fn, capture = _compiled(_step_with_global, "_direct_test_global")
    x = torch.randn(2, 4)
    block = _Block(3)
    with torch.inference_mode():
        fn(block, x)
    reason = bind(capture, {"x": x}, {"block": block})
    assert isinstance(reason, str) and "neither an input nor a tensor" in reason
    calls = direct_call.DirectCalls(enabled=True)
    assert calls.learn("k", capture, {"x": x}, {"block": block}) is None
    assert calls.get("k") is None
    assert bind(CapturingInductor({}), {}, {}) == "the graph was not captured"


def _count_direct_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    seen = {"calls": 0}
    inner = BoundCall.__call__

    def counting(self: BoundCall, **inputs: torch.Tensor) -> torch.Tensor:
        seen["calls"] += 1
        return inner(self, **inputs)

    monkeypatch.setattr(BoundCall, "__call__", counting)
    return seen


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_engine_decodes_through_the_bound_graphs(
    tiny_llama: Path, scope: str, engine_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=2, compile_scope=scope)
    gr = eng.worker.scheduler.runner.graph_runner
    assert set(gr._head_calls) == set(gr.buckets)  # bound by the warmup's first calls
    bound = gr._layer_calls if scope == "layer" else gr._stack_calls
    assert set(bound) == set(gr.buckets)
    if scope == "layer":
        assert all(len(calls) == len(gr.model.layers) for calls in bound.values())
    seen = _count_direct_calls(monkeypatch)
    prompts = prompts_of([5, 21], seed=3)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
    per_step = 1 + (len(gr.model.layers) if scope == "layer" else 1)  # the head and the layers / the stack
    assert seen["calls"] >= per_step * (GREEDY["max_new_tokens"] - 1)


def test_direct_calls_off(tiny_llama: Path, engine_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """RADIXRT_COMPILE_DIRECT_CALL=0: every call through dynamo, the same ids; a bad value names the
    variable."""
    monkeypatch.setenv(direct_call.DIRECT_CALL_ENV, "0")
    eng = engine_factory(tiny_llama, disable_compile=False, compile_max_bs=2)
    gr = eng.worker.scheduler.runner.graph_runner
    seen = _count_direct_calls(monkeypatch)
    prompts = prompts_of([9, 4], seed=5)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == hf_greedy(tiny_llama, ids, GREEDY["max_new_tokens"])
    assert seen["calls"] == 0 and not gr._layer_calls and not gr._head_calls
    monkeypatch.setenv(direct_call.DIRECT_CALL_ENV, "on")
    with pytest.raises(ValueError, match=direct_call.DIRECT_CALL_ENV):
        direct_call.direct_call_enabled()
