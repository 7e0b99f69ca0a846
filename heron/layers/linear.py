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
        self.quant_method.create_weights(self, input_size, output_sizes, torch.get_default_dtype())
        self.bias = linear_parameter(torch.empty(self.output_size), output_dim=0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy a checkpoint tensor into ``param`` (casting to its dtype): all of it, or projection ``shard_id``'s
        rows along its ``output_dim``, or that projection's slot when it has none."""
        target = param.data
        if shard_id is not None:
            output_dim = getattr(param, "output_dim", None)
            if output_dim is None:
                target = target[shard_id]
            else:
                offset = sum(self.output_sizes[:shard_id])
                target = target.narrow(output_dim, offset, self.output_sizes[shard_id])
        if _squeezed(target.shape) != _squeezed(loaded.shape):
            where = "parameter" if shard_id is None else f"shard {shard_id}"
            raise ValueError(f"shape mismatch: {where} {tuple(target.shape)} vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded.reshape(target.shape))

    def _apply(self, fn, recurse=True):
        # moving off the meta device (to_empty) replaces Parameter objects: keep the attributes set on them
        attrs = {name: dict(vars(p)) for name, p in self._parameters.items() if p is not None}
        super()._apply(fn, recurse)
        for name, param_attrs in attrs.items():
            vars(self._parameters[name]).update(param_attrs)
        return self


def _squeezed(shape: torch.Size) -> list[int]:
    """A shape without its size-1 axes: a scale stored as [] or [n] fits a parameter of [1] or [n, 1]."""
    return [d for d in shape if d != 1]


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
