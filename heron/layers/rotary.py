"""Rotary position embedding (rotate-half form), with the scalings transformers knows (llama3, linear, yarn...)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from heron.kernels import kernels_for


def _rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


@dataclass
class RopeInputs:
    """A forward's positions, with their cos and sin when RoPE runs as PyTorch ops."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key tensors of shape ``[tokens, heads, head_dim]`` at given positions."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = _inv_freq(config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """What every layer's ``forward`` needs at ``positions``, computed once per model forward: the
        positions alone where the C++ kernel applies RoPE, else cos and sin shaped to broadcast over heads."""
        if kernels_for(positions) is not None:
            return RopeInputs(positions)
        return RopeInputs(positions, self.cos[positions].unsqueeze(1).to(dtype),
                          self.sin[positions].unsqueeze(1).to(dtype))

    def forward(self, rope: RopeInputs, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q [T, heads, dim] and k [T, kv_heads, dim] (in place on the kernel path)."""
        if rope.cos is None:
            kernels_for(q).rotary_embedding(rope.positions, q, k, self.cos, self.sin)
            return q, k
        return (q * rope.cos + self._rotate_half(q) * rope.sin,
                k * rope.cos + self._rotate_half(k) * rope.sin)
