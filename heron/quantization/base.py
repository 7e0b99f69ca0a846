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

from heron.cpu import has_native_bf16
from heron.kernels import kernels_for

GEMV_MAX_ROWS = 4  # the rows heron's bfloat16 matrix-vector kernel takes (it reads W once for all of them)


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
        """``F.linear(x, weight, bias)``; up to ``GEMV_MAX_ROWS`` bfloat16 rows on a CPU with native bfloat16 go
        through heron's one-row kernel instead."""
        if x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16 and x.is_contiguous():
            kernels = kernels_for(x)
            if kernels is not None and has_native_bf16():
                # torch's one-row bf16 kernels read the weight at about half the memory speed here
                # (docs/performance.md): a small batch's decode step is mostly these products
                return kernels.gemv_bf16(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)
