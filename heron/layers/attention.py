"""The attention layer of a model: hands queries, keys and values to the step's attention backend.

The layer holds its slice of the KV pool (``kv_cache``, laid out as the backend wants) and its sliding
window; the backend and the flat per-step metadata come from the model runner.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.attention.backend import AttentionBackend, AttentionMetadata


class PagedAttention(nn.Module):
    """Attention whose keys and values live in a paged pool owned by the model runner."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.backend: AttentionBackend | None = None
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``q``: [T, heads, dim]; ``k``, ``v``: [T, kv_heads, dim]. Returns [T, heads * dim]."""
        return self.backend.forward(q, k, v, self.kv_cache, meta, self.sliding_window).flatten(1)
