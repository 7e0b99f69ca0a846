"""Quantization methods by name: the ``--quantization`` value or a checkpoint's ``quantization_config``."""

from __future__ import annotations

from collections.abc import Callable

from heron.errors import ModelLoadError
from heron.quantization.base import QuantizationMethod, UnquantizedLinearMethod

QUANTIZATION_METHODS: dict[str, Callable[[], QuantizationMethod]] = {"none": UnquantizedLinearMethod}


def register_quantization_method(name: str, factory: Callable[[], QuantizationMethod]) -> None:
    """Make ``name`` resolve to ``factory`` (for methods defined outside heron, and tests)."""
    QUANTIZATION_METHODS[name] = factory


def get_quantization_method(name: str | None) -> Callable[[], QuantizationMethod]:
    """The factory of method ``name`` (None or "none": unquantized), or a ModelLoadError naming the known ones."""
    factory = QUANTIZATION_METHODS.get(name or "none")
    if factory is None:
        raise ModelLoadError(f"quantization method {name!r} is not supported; "
                             f"supported: {', '.join(QUANTIZATION_METHODS)}")
    return factory


def quantization_method_for(hf_config) -> QuantizationMethod:
    """A method for the quantized linear layers of a model, from ``hf_config.quantization_config`` (if any)."""
    quant_config = getattr(hf_config, "quantization_config", None) or {}
    return get_quantization_method(quant_config.get("quant_method"))()
