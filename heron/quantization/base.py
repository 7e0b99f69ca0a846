"""The seam between linear layers and weight formats (vLLM's LinearMethodBase): a quantization method registers
a layer's weight parameters, may repack them once loaded, and computes the layer's matmul from them.

A parameter with a per-output-row axis carries an ``output_dim`` attribute naming it (see ``linear_parameter``);
a merged layer's loader places checkpoint shard i in that axis' rows of projection i. A parameter without one
(a per-tensor scale) holds one slot per projection along dim 0: shape ``[len(output_sizes)]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


def linear_parameter(data: torch.Tensor, output_dim: int | None = None) -> nn.Parameter:
    """A frozen parameter of a linear layer; ``output_dim`` is its per-output-row axis, if it has one."""
    param = nn.Parameter(data, requires_grad=False)
    param.output_dim = output_dim
    return param


class QuantizationMethod(ABC):
    """How a linear layer stores its weight and computes ``x W^T + b``; stateless, all state lives on the layer."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register the weight parameters of ``layer``, whose output is the row blocks ``output_sizes``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Repack the loaded parameters for ``apply`` (transpose, fuse scales...); nothing by default."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` computed from ``layer``'s parameters."""


class UnquantizedLinearMethod(QuantizationMethod):
    """A dense ``weight`` [out, in] in the model dtype, multiplied with ``F.linear``."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register ``weight`` [sum(output_sizes), input_size]."""
        weight = torch.empty(sum(output_sizes), input_size, dtype=params_dtype)
        layer.register_parameter("weight", linear_parameter(weight, output_dim=0))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``; one bfloat16 row on the CPU goes through ``torch.mv`` instead."""
        if x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            # torch's bf16 matrix-vector kernel runs at about twice the speed of its one-row GEMM here
            # (docs/performance.md): a single stream's decode step is mostly these products
            y = torch.mv(layer.weight, x[0]).unsqueeze(0)
            return y if bias is None else y + bias
        return F.linear(x, layer.weight, bias)
