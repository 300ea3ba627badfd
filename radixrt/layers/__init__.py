"""Model layers for the CPU fast path: weight-only quantized linears chosen by ``--quantization``.

The GGUF mapping lives in :mod:`radixrt.layers.gguf_linear` (imported lazily: it needs the ``gguf``
package).
"""

from __future__ import annotations

from radixrt.layers.quant_linear import (
    INT4_GROUP_SIZES,
    KERNEL_DTYPES,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    QuantLinearBase,
)
from radixrt.layers.quant_math import quantize_int4_groupwise, quantize_int8_per_channel
from radixrt.layers.quantization import (
    QUANT_METHODS,
    QUANTIZATION_CHOICES,
    QuantMethod,
    QuantOptions,
    get_quant_method,
    keep_dense_weights,
    quantize_linear,
    quantize_model_linears,
    use_radixrt_int4_kernel,
)

__all__ = [
    "INT4_GROUP_SIZES",
    "KERNEL_DTYPES",
    "QUANTIZATION_CHOICES",
    "QUANT_METHODS",
    "DenseLinear",
    "Int4Linear",
    "Int8Linear",
    "QuantLinearBase",
    "QuantMethod",
    "QuantOptions",
    "get_quant_method",
    "keep_dense_weights",
    "quantize_int4_groupwise",
    "quantize_int8_per_channel",
    "quantize_linear",
    "quantize_model_linears",
    "use_radixrt_int4_kernel",
]
