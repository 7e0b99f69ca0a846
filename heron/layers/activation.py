"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.kernels import kernels_for


class SiluAndMul(nn.Module):
    """SwiGLU: ``silu(gate) * up`` on the two halves of a merged gate/up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = kernels_for(x)
        if kernels is not None and x.is_contiguous():
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
