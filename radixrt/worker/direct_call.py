"""Compiled decode graphs called without dynamo's per-call machinery.

A function from ``torch.compile`` enters its graph through ~40 us of Python on every call on this 2-core
machine: dynamo's frame callback, the bytecode that reads each parameter off the module ("pregraph"), the
config patching around the call, and the disable context (a trivial graph of 12 inputs: 53 us a call through
``torch.compile`` without guards, 12 us calling the compiled graph itself). A decode step calls 30 layer
graphs and the greedy head, so at batch 1 that is ~1.2 ms of a ~20 ms step.

:class:`CapturingInductor` is a ``torch.compile`` backend that compiles with inductor exactly as
``backend="inductor"`` with the same options would, and keeps the compiled graph and the tensors its first
call received. :func:`bind` then finds where each of those tensors lives -- a dynamic input (``x``,
``positions``) or a tensor of one of the call's modules (``layer.self_attn.qkv_proj.i4_codes``, the rotary
cache) -- so :class:`DirectCall` can build the same argument list for any layer of the kind, from that
layer's own tensors, and call the graph directly. What the graph reads is fixed by construction (module doc
of :mod:`radixrt.worker.graph_runner`: a function is only ever called with its bucket's shapes and layers of
its kind), the same premise under which the graphs already run without dynamo guards. A tensor that cannot
be placed (a global, a tensor made inside the traced code) leaves the function on the dynamo path, logged.

``RADIXRT_COMPILE_DIRECT_CALL=0`` keeps every call on the dynamo path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from radixrt.config.env import env_switch

logger = logging.getLogger(__name__)

DIRECT_CALL_ENV = "RADIXRT_COMPILE_DIRECT_CALL"


def direct_call_enabled() -> bool:
    """``RADIXRT_COMPILE_DIRECT_CALL``: 1 (default) calls captured graphs directly, 0 through dynamo;
    ValueError for anything else."""
    return env_switch(DIRECT_CALL_ENV)


class CapturingInductor:
    """A ``torch.compile`` backend: inductor with ``config_patches`` (what ``options`` gives
    ``backend="inductor"``), keeping the compiled graph (:attr:`compiled`) and the arguments of its first
    call (:attr:`first_args`)."""

    def __init__(self, config_patches: Mapping[str, Any]) -> None:
        self.config_patches = dict(config_patches)
        self.compiled: Callable[..., Any] | None = None
        self.first_args: tuple[Any, ...] | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        compiled: Callable[..., Any] = cast(
            "Callable[..., Any]", compile_fx(gm, list(example_inputs), config_patches=self.config_patches)
        )
        self.compiled = compiled

        def call(*args: Any) -> Any:
            if self.first_args is None:
                self.first_args = args
            return compiled(*args)

        return call


# A slot of the graph's argument list: ("input", name) for a dynamic input, ("tensor", root, attribute path)
# for a tensor of a root module, resolved per call site.
Slot = tuple[str, ...]


def _tensor_paths(root: torch.nn.Module) -> dict[int, str]:
    """id of every tensor a module holds (parameters, buffers, tensor attributes, at any depth) -> its dotted
    path; the first path wins where a tensor is held twice."""
    paths: dict[int, str] = {}
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        held = {**mod._parameters, **mod._buffers}
        held.update({k: v for k, v in vars(mod).items() if isinstance(v, torch.Tensor)})
        for key, t in held.items():
            if isinstance(t, torch.Tensor):
                paths.setdefault(id(t), prefix + key)
    return paths


def bind(
    capture: CapturingInductor, inputs: Mapping[str, torch.Tensor], modules: Mapping[str, torch.nn.Module]
) -> DirectCall | str:
    """The captured graph as a :class:`DirectCall`, its first call's arguments placed among ``inputs``
    (dynamic, by name) and the tensors of ``modules`` (by root name and path) -- or why it cannot be."""
    if capture.compiled is None or capture.first_args is None:
        return "the graph was not captured"
    paths = {name: _tensor_paths(mod) for name, mod in modules.items()}
    slots: list[Slot] = []
    for i, arg in enumerate(capture.first_args):
        if not isinstance(arg, torch.Tensor):
            return f"argument {i} is a {type(arg).__name__}, not a tensor"
        slot: Slot | None = next((("input", n) for n, t in inputs.items() if t is arg), None)
        if slot is None:
            slot = next((("tensor", r, p[id(arg)]) for r, p in paths.items() if id(arg) in p), None)
        if slot is None:
            return f"argument {i} ({tuple(arg.shape)}) is neither an input nor a tensor of {sorted(modules)}"
        slots.append(slot)
    return DirectCall(capture.compiled, tuple(slots))


@dataclass(frozen=True)
class DirectCall:
    """A compiled graph and where each of its arguments comes from (:func:`bind`)."""

    compiled: Callable[..., Any]
    slots: tuple[Slot, ...]

    def template(self, modules: Mapping[str, torch.nn.Module]) -> tuple[list[Any], list[tuple[int, str]]]:
        """The argument list for ``modules`` (this call site's roots) with the dynamic inputs left as None,
        and ``(position, input name)`` of each of those."""
        args: list[Any] = []
        dynamic: list[tuple[int, str]] = []
        for i, slot in enumerate(self.slots):
            if slot[0] == "input":
                args.append(None)
                dynamic.append((i, slot[1]))
                continue
            obj: Any = modules[slot[1]]
            for part in slot[2].split("."):
                obj = getattr(obj, part)
            args.append(obj)
        return args, dynamic


class BoundCall:
    """One call site of a :class:`DirectCall`: its fixed tensors resolved once, the inputs filled per call."""

    __slots__ = ("_args", "_compiled", "_dynamic")

    def __init__(self, direct: DirectCall, modules: Mapping[str, torch.nn.Module]) -> None:
        self._compiled = direct.compiled
        self._args, self._dynamic = direct.template(modules)

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        args = list(self._args)
        for i, name in self._dynamic:
            args[i] = inputs[name]
        out = self._compiled(*args)
        if len(out) != 1:
            raise RuntimeError(f"a direct call returned {len(out)} outputs, expected the graph's one")
        return out[0]  # type: ignore[no-any-return]


class DirectCalls:
    """The :class:`DirectCall` of each captured graph by key, bound right after the graph's first call
    through dynamo (:meth:`learn`); a graph that cannot be bound stays on the dynamo path (logged once)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._calls: dict[Hashable, DirectCall | None] = {}

    def get(self, key: Hashable) -> DirectCall | None:
        """The bound graph of ``key``; None before :meth:`learn` or where it could not be bound."""
        return self._calls.get(key)

    def learn(
        self,
        key: Hashable,
        capture: CapturingInductor,
        inputs: Mapping[str, torch.Tensor],
        modules: Mapping[str, torch.nn.Module],
    ) -> DirectCall | None:
        """Bind ``key``'s graph once, from the call that just ran with ``inputs`` and ``modules``."""
        if not self.enabled or key in self._calls:
            return self._calls.get(key)
        bound = bind(capture, inputs, modules)
        if isinstance(bound, str):
            logger.info("compiled decode %s: called through dynamo (%s)", key, bound)
            self._calls[key] = None
            return None
        self._calls[key] = bound
        return bound
