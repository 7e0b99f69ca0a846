"""Weight quantization of linear layers: the method interface, the dense default and the registry by name."""

from heron.quantization.base import QuantizationMethod, UnquantizedLinearMethod, linear_parameter
from heron.quantization.registry import (
    get_quantization_method,
    quantization_method_for,
    register_quantization_method,
)

__all__ = ["QuantizationMethod", "UnquantizedLinearMethod", "get_quantization_method", "linear_parameter",
           "quantization_method_for", "register_quantization_method"]
