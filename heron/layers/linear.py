"""Linear layers. Models build every projection through these classes, so a quantized or sharded variant
replaces them in one place; ``weight_loader`` lets a checkpoint tensor land in its slice of a merged weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x W^T + b`` with a dense weight."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy a checkpoint tensor into ``param`` (the whole of it; merged layers override this)."""
        if param.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded)


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul (q/k/v, or gate/up).

    ``shard_id`` i of the checkpoint lands in rows ``[sum(sizes[:i]), sum(sizes[:i+1]))``.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            return super().weight_loader(param, loaded)
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: shard {shard_id} {tuple(target.shape)} vs checkpoint "
                             f"{tuple(loaded.shape)}")
        target.copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a fused output back into its projections."""
        return y.split(self.output_sizes, dim=-1)
