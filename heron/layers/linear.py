"""Linear layers. Models build every projection through these classes; a quantization method decides how the
weight is stored and multiplied, and ``weight_loader`` lets a checkpoint tensor land in its slice of a merged
layer's parameters (see heron/quantization/base.py for the ``output_dim`` convention)."""

from __future__ import annotations

import torch
from torch import nn

from heron.quantization.base import QuantizationMethod, UnquantizedLinearMethod, linear_parameter


class LinearBase(nn.Module):
    """``y = x W^T + b`` whose output is the row blocks ``output_sizes``; W's form is up to ``quant_method``."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_method: QuantizationMethod | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.output_size = sum(output_sizes)
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.params_dtype = torch.get_default_dtype()  # the model dtype: activations arrive in it
        self.quant_method.create_weights(self, input_size, output_sizes, self.params_dtype)
        self.bias = linear_parameter(torch.empty(self.output_size), output_dim=0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Load a checkpoint tensor into ``param`` (all of it, or projection ``shard_id``'s part): the
        quantization method's ``load``."""
        self.quant_method.load(self, param, loaded, shard_id)

    def _apply(self, fn, recurse=True):
        # moving off the meta device (to_empty) replaces Parameter objects: keep the attributes set on them
        attrs = {name: dict(vars(p)) for name, p in self._parameters.items() if p is not None}
        super()._apply(fn, recurse)
        for name, param_attrs in attrs.items():
            vars(self._parameters[name]).update(param_attrs)
        return self


class Linear(LinearBase):
    """A single projection."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: QuantizationMethod | None = None) -> None:
        super().__init__(input_size, [output_size], bias, quant_method)


class MergedLinear(LinearBase):
    """Several projections of the same input fused into one matmul (q/k/v, or gate/up).

    ``shard_id`` i of the checkpoint lands in rows ``[sum(sizes[:i]), sum(sizes[:i+1]))``.
    """

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a fused output back into its projections."""
        return y.split(self.output_sizes, dim=-1)
