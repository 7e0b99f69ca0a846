"""RMSNorm, optionally fused with the residual add that precedes it (one C++ op on the CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.kernels import kernels_for


class RMSNorm(nn.Module):
    """Root-mean-square layer norm as Llama defines it (computed in float32)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same numbers as the unfused form in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``, returns ``(norm(x + residual), x + residual)`` (on the CPU the sum is
        written into ``residual``)."""
        kernels = kernels_for(x)
        if kernels is not None and x.is_contiguous() and self.weight.dtype == x.dtype:
            out = kernels.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
