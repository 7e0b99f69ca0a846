"""Linear layers. Models build every projection through these classes; a quantization method decides how the
weight is stored and multiplied, and ``weight_loader`` lets a checkpoint tensor land in its slice of a merged
layer's parameters (see heron/quantization/base.py for the ``output_dim`` / ``input_dim`` convention).

Under tensor parallelism (Megatron's scheme) a layer holds one part of its weight: a column-parallel layer
(``output_parts``) some rows of each projection, a row-parallel one (``RowParallelLinear``) some input columns,
summed over the ranks by one all-reduce. The loader cuts each checkpoint tensor to this rank's part before the
quantization method sees it, so every method that loads a dense-shaped weight shards the same way, its scales
with it.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.distributed.parallel_state import all_reduce, get_tp_group
from heron.errors import ConfigError
from heron.quantization.base import QuantizationMethod, UnquantizedLinearMethod, linear_parameter

Part = tuple[int, int]  # (index, count): this rank holds part ``index`` of ``count`` equal parts of an axis
WHOLE: Part = (0, 1)


def narrow_part(t: torch.Tensor, dim: int, part: Part) -> torch.Tensor:
    """Part ``part`` of ``t`` along ``dim``."""
    index, count = part
    if count == 1:
        return t
    size = t.shape[dim]
    if size % count:
        raise ValueError(f"axis {dim} of size {size} does not split into {count} equal tensor-parallel parts")
    return t.narrow(dim, index * size // count, size // count)


def _part_size(size: int, part: Part, what: str) -> int:
    if size % part[1]:
        raise ConfigError(f"{what} of size {size} does not split into {part[1]} tensor-parallel parts")
    return size // part[1]


class LinearBase(nn.Module):
    """``y = x W^T + b`` whose output is the row blocks ``output_sizes``; W's form is up to ``quant_method``.

    ``output_parts[i]`` is the part of projection i's rows this rank holds, ``input_part`` the part of the
    input columns (both whole by default); sizes are given whole, the layer holds its parts.
    """

    # its input rows are the step's flat batch, whose prompt rows heron/layers/prompt_rows.py names (the LM
    # head's are the rows to sample)
    step_rows = True
    # its output in float32 where the weight's kernel computes in float32 anyway (the LM head: logits not rounded
    # to the model dtype, as llama.cpp's; the sampler wants float32)
    float_output = False

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_method: QuantizationMethod | None = None, output_parts: list[Part] | None = None,
                 input_part: Part = WHOLE) -> None:
        super().__init__()
        self.output_parts = output_parts or [WHOLE] * len(output_sizes)
        self.input_part = input_part
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.sharded = input_part != WHOLE or any(p != WHOLE for p in self.output_parts)
        if self.sharded and not self.quant_method.tensor_parallel:
            raise ConfigError(f"{type(self.quant_method).__name__} weights cannot be sharded for tensor "
                              "parallelism yet; use --tensor-parallel-size 1")
        self.input_size = _part_size(input_size, input_part, "a layer's input")
        self.output_sizes = [_part_size(size, part, "a layer's output")
                             for size, part in zip(output_sizes, self.output_parts, strict=True)]
        self.output_size = sum(self.output_sizes)
        self.params_dtype = torch.get_default_dtype()  # the model dtype: activations arrive in it
        self.quant_method.create_weights(self, self.input_size, self.output_sizes, self.params_dtype)
        self.bias = linear_parameter(torch.empty(self.output_size), output_dim=0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Load this rank's part of a checkpoint tensor into ``param`` (all of it, or projection ``shard_id``'s
        part): the quantization method's ``load``."""
        self.quant_method.load(self, param, self.shard(param, loaded, shard_id), shard_id)

    def shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``loaded`` (projection ``shard_id``'s, or the layer's only one)."""
        if not self.sharded:
            return loaded
        output_dim, input_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
        try:
            if output_dim is not None:
                loaded = narrow_part(loaded, output_dim, self.output_parts[shard_id or 0])
            if input_dim is not None:
                loaded = narrow_part(loaded, input_dim, self.input_part)
        except ValueError as e:  # e.g. a part that would cut through a GGUF block
            raise ConfigError(f"{e}; choose another --tensor-parallel-size") from e
        return loaded

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
    """Several projections of the same input fused into one matmul (q/k/v, or gate/up); column-parallel with
    ``output_parts``.

    ``shard_id`` i of the checkpoint lands in rows ``[sum(sizes[:i]), sum(sizes[:i+1]))`` (of this rank's parts).
    """

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a fused output back into its projections."""
        return y.split(self.output_sizes, dim=-1)


class RowParallelLinear(LinearBase):
    """A projection whose input columns are split over the tensor-parallel ranks (Megatron's row-parallel
    layer): each rank multiplies its part of the input, one all-reduce sums the parts, the bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: QuantizationMethod | None = None) -> None:
        super().__init__(input_size, [output_size], bias, quant_method, input_part=get_tp_group().part())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return super().forward(x)
        y = all_reduce(self.quant_method.apply(self, x, None))
        return y if self.bias is None else y + self.bias
