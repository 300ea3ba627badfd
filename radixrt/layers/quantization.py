"""Quantization methods by name (SGLang's ``--quantization`` flag) and in-place model conversion.

=======  ==========================================================================================
method   what every ``nn.Linear`` becomes
=======  ==========================================================================================
none     left as is
int8     :class:`Int8Linear`: symmetric per-output-channel int8 (``torch._weight_int8pack_mm``)
int4     :class:`Int4Linear`: asymmetric 4-bit, scale + zero per ``group_size`` inputs (default 32;
         32/64/128/256 allowed, ``in`` must be a multiple), ``torch._weight_int4pack_mm_for_cpu``
gguf     the weight quantized to ``ggml_type`` by ``gguf.quants.quantize`` and mapped as in
         :mod:`radixrt.layers.gguf_linear` (weights that already are GGUF blocks: use
         :func:`radixrt.layers.gguf_linear.gguf_linear` directly)
=======  ==========================================================================================

Quantize after the weights are loaded: a replaced module has no ``.weight`` Parameter, so a later
re-tie (``lm_head.weight = embed_tokens.weight``) or a state-dict load of float weights won't reach it.
A tied LM head is quantized from the shared weight; the embedding keeps the float tensor.

Speed (torch 2.13, 2-core AVX512-BF16 CPU, one thread, per call): only the bf16 kernels are
vectorised; fp32 activations run a scalar loop 13-30x slower than bf16, so run quantized models in bf16
or pass ``compute_dtype=torch.bfloat16`` (x is cast to bf16 for the kernel and the result back). The
576 -> 49152 LM head at T=1: fp32 F.linear 9.4 ms, bf16 6.3 ms, int8 3.4 ms, int4 1.5 ms; at T=32 bf16
F.linear (14 ms) beats int4 (22 ms) and int8 (47 ms): weight-only kernels pay off for decode, not prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from radixrt.layers.quant_linear import (
    INT4_GROUP_SIZES,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    QuantLinearBase,
    _check_dtype,
)


@dataclass(frozen=True)
class QuantOptions:
    """Per-method options: ``group_size`` (int4), ``ggml_type`` (gguf), ``compute_dtype`` (all but none)."""

    group_size: int = 32
    ggml_type: str | int = "Q8_0"
    compute_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class QuantMethod:
    """A named quantization method: ``convert(linear, options)`` returns the replacement module."""

    name: str
    description: str
    convert: Callable[[nn.Linear, QuantOptions], nn.Module]
    validate: Callable[[QuantOptions], None]


def _no_check(opts: QuantOptions) -> None:
    if opts.compute_dtype is not None:
        _check_dtype(opts.compute_dtype)


def _check_int4(opts: QuantOptions) -> None:
    _no_check(opts)
    if opts.group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"unsupported int4 group size {opts.group_size}; supported: {list(INT4_GROUP_SIZES)}"
        )


def _check_gguf(opts: QuantOptions) -> None:
    from radixrt.layers.gguf_linear import parse_ggml_type

    _no_check(opts)
    parse_ggml_type(opts.ggml_type)


def _none(linear: nn.Linear, opts: QuantOptions) -> nn.Module:
    return linear


def _int8(linear: nn.Linear, opts: QuantOptions) -> nn.Module:
    return Int8Linear.from_float(linear.weight, linear.bias, compute_dtype=opts.compute_dtype)


def _int4(linear: nn.Linear, opts: QuantOptions) -> nn.Module:
    return Int4Linear.from_float(
        linear.weight, linear.bias, opts.group_size, compute_dtype=opts.compute_dtype
    )


def _gguf(linear: nn.Linear, opts: QuantOptions) -> nn.Module:
    from radixrt.layers.gguf_linear import gguf_linear_from_float

    return gguf_linear_from_float(
        linear.weight, opts.ggml_type, linear.bias, compute_dtype=opts.compute_dtype
    )


#: The registry, keyed by ``--quantization`` value.
QUANT_METHODS: dict[str, QuantMethod] = {
    m.name: m
    for m in (
        QuantMethod("none", "unquantized nn.Linear", _none, _no_check),
        QuantMethod("int8", "int8 weight-only, per-output-channel scales", _int8, _no_check),
        QuantMethod("int4", "int4 weight-only, group-wise scales and zeros", _int4, _check_int4),
        QuantMethod("gguf", "GGUF block quantization mapped to int4/int8 kernels", _gguf, _check_gguf),
    )
}
#: Valid ``--quantization`` values.
QUANTIZATION_CHOICES: tuple[str, ...] = tuple(QUANT_METHODS)


def keep_dense_weights(model: nn.Module, min_tokens: int, int8: bool = False) -> int:
    """Give every weight-only quantized linear of ``model`` its dense twin for batches of ``>= min_tokens``
    rows (:meth:`QuantLinearBase.keep_dense_weight`); returns the bytes kept (0 when none is quantized).

    Prefill and extend batches then run oneDNN's dense GEMM (~800 GFLOP/s in bf16 on 2 AVX512-BF16 cores
    at a few hundred rows, against ~300 for the int4 kernel and ~250 for int8 at any batch size), decode
    steps the quantized kernel, which reads a quarter of the bytes. ``int8``: an int8 copy multiplied with
    int8 activations instead (``--dense-gemm-int8``).
    """
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    done: set[int] = set()
    kept = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinearBase) and not isinstance(mod, DenseLinear) and id(mod) not in done:
            done.add(id(mod))
            kept += mod.keep_dense_weight(min_tokens, int8)
    return kept


def use_radixrt_int4_kernel(model: nn.Module, dtype: torch.dtype, act_int8: bool = False) -> int:
    """Give every :class:`Int4Linear` of ``model`` (and in float32 every :class:`Int8Linear`) the layout of
    radixrt's kernel for ``dtype`` batches (``use_radixrt_kernel``; ``act_int8``: float32 int4 linears
    multiply int8-rounded activations); returns the bytes kept (0 when none is quantized)."""
    kept = 0
    done: set[int] = set()
    for mod in model.modules():
        if id(mod) in done:
            continue
        if isinstance(mod, Int4Linear) or (isinstance(mod, Int8Linear) and dtype == torch.float32):
            done.add(id(mod))
            kept += (
                mod.use_radixrt_kernel(dtype, act_int8)
                if isinstance(mod, Int4Linear)
                else mod.use_radixrt_kernel(dtype)
            )
    return kept


def get_quant_method(name: str | None) -> QuantMethod:
    """The method registered as ``name`` (None means "none"); ``ValueError`` naming it otherwise."""
    key = "none" if name is None else name.lower()
    if key not in QUANT_METHODS:
        raise ValueError(f"unsupported quantization method {name!r}; supported: {', '.join(QUANT_METHODS)}")
    return QUANT_METHODS[key]


def quantize_linear(
    linear: nn.Linear,
    method: str,
    *,
    group_size: int = 32,
    ggml_type: str | int = "Q8_0",
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """The replacement for one ``nn.Linear`` under ``method`` (the same module for "none")."""
    qm = get_quant_method(method)
    opts = QuantOptions(group_size, ggml_type, compute_dtype)
    qm.validate(opts)
    return qm.convert(linear, opts)


def quantize_model_linears(
    model: nn.Module,
    method: str,
    skip: Callable[[str], bool] | None = None,
    *,
    group_size: int = 32,
    ggml_type: str | int = "Q8_0",
    compute_dtype: torch.dtype | None = None,
) -> list[str]:
    """Replace every ``nn.Linear`` submodule of ``model`` in place; returns the qualified names replaced.

    ``skip(name)`` True keeps that Linear. A Linear reachable under several names is converted once and
    the result shared. All replacements are built before any is installed, so an error (unsupported
    method, option or shape) leaves the model untouched. The root module itself is never replaced.
    """
    qm = get_quant_method(method)
    opts = QuantOptions(group_size, ggml_type, compute_dtype)
    qm.validate(opts)
    if qm.name == "none":
        return []
    sites: list[tuple[nn.Module, str, str, nn.Linear]] = []
    seen_sites: set[tuple[int, str]] = set()
    for prefix, parent in model.named_modules(remove_duplicate=False):
        for child_name, child in parent._modules.items():
            if not isinstance(child, nn.Linear) or (id(parent), child_name) in seen_sites:
                continue
            seen_sites.add((id(parent), child_name))
            qualname = f"{prefix}.{child_name}" if prefix else child_name
            if skip is None or not skip(qualname):
                sites.append((parent, child_name, qualname, child))
    built: dict[int, nn.Module] = {}
    for _, _, _, linear in sites:
        if id(linear) not in built:
            built[id(linear)] = qm.convert(linear, opts)
    for parent, child_name, _, linear in sites:
        setattr(parent, child_name, built[id(linear)])
    return [qualname for _, _, qualname, _ in sites]
