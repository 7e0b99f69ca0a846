"""Quantization methods by name: the ``--quantization`` value or a checkpoint's ``quantization_config``.

Methods are imported on first use ("module:Class" entries), so a format's dependencies load only when it is.
"""

from __future__ import annotations

import importlib

from heron.errors import ModelLoadError
from heron.quantization.base import QuantizationMethod, UnquantizedLinearMethod

QUANTIZATION_METHODS: dict[str, type[QuantizationMethod] | str] = {
    "none": UnquantizedLinearMethod,
    "gguf": "heron.quantization.gguf:GGUFLinearMethod",
    "int8": "heron.quantization.int_weight:Int8LinearMethod",
    "int4": "heron.quantization.int_weight:Int4LinearMethod",
    "awq": "heron.quantization.awq_gptq:AWQLinearMethod",
    "gptq": "heron.quantization.awq_gptq:GPTQLinearMethod",
    "fp8": "heron.quantization.fp8:Fp8LinearMethod",
    "compressed-tensors": "heron.quantization.fp8:CompressedTensorsLinearMethod",
}


def register_quantization_method(name: str, method: type[QuantizationMethod]) -> None:
    """Make ``name`` resolve to ``method`` (for methods defined outside heron, and tests)."""
    QUANTIZATION_METHODS[name] = method


def get_quantization_method(name: str | None) -> type[QuantizationMethod]:
    """The class of method ``name`` (None or "none": unquantized), or a ModelLoadError naming the known ones."""
    method = QUANTIZATION_METHODS.get(name or "none")
    if method is None:
        raise ModelLoadError(f"quantization method {name!r} is not supported; "
                             f"supported: {', '.join(QUANTIZATION_METHODS)}")
    if isinstance(method, str):
        module, cls = method.split(":")
        method = QUANTIZATION_METHODS[name] = getattr(importlib.import_module(module), cls)
    return method


def quantization_method_for(hf_config, layer: str) -> QuantizationMethod:
    """The method of linear layer ``layer`` (its name in the model, e.g. "qkv_proj", "lm_head"), from
    ``hf_config.quantization_config`` (unquantized where there is none)."""
    quant_config = getattr(hf_config, "quantization_config", None) or {}
    return get_quantization_method(quant_config.get("quant_method")).for_layer(quant_config, layer)
