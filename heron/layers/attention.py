"""Paged attention over a flattened token batch.

Every step writes the new tokens' keys and values into the KV pool through ``slot_mapping`` and then reads each
sequence's whole context back through its block table. Sequences are grouped so that one fused SDPA call
serves each group: all decode tokens (one query each) form one group, prefill chunks (which may attend to
earlier cached blocks) another, padded to the longest chunk and masked causally per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionGroup:
    """Sequences attended together in one SDPA call.

    ``query_index[b, i]`` is the flat token index of sequence b's i-th new token (padding points at token 0);
    ``mask[b, 0, i, j]`` allows query i of sequence b to see context slot j.
    ``valid`` selects the real (unpadded) entries of ``[B, Q]``; ``out_index`` are their flat token indices.
    """

    query_index: torch.Tensor  # [B, Q] long
    block_tables: torch.Tensor  # [B, max_blocks] long
    mask: torch.Tensor  # [B, 1, Q, L] bool
    valid: torch.Tensor  # [B, Q] bool
    out_index: torch.Tensor  # [n_valid] long


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every attention layer."""

    slot_mapping: torch.Tensor  # [T] long: KV pool slot of each new token
    groups: list[AttentionGroup]

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              slot_mapping: list[int], block_size: int, device: torch.device) -> AttentionMetadata:
        """Group sequences by decode (one query) vs prefill and precompute indices and masks.

        ``context_lens[b]`` counts all of b's tokens in the cache after this step (earlier ones + new ones).
        """
        decode = [b for b, q in enumerate(query_lens) if q == 1]
        prefill = [b for b, q in enumerate(query_lens) if q > 1]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        groups = [cls._group(members, query_lens, context_lens, block_tables, starts, block_size, device)
                  for members in (decode, prefill) if members]
        return cls(torch.tensor(slot_mapping, dtype=torch.long, device=device), groups)

    @staticmethod
    def _group(members: list[int], query_lens: list[int], context_lens: list[int],
               block_tables: list[list[int]], starts: list[int], block_size: int,
               device: torch.device) -> AttentionGroup:
        max_q = max(query_lens[b] for b in members)
        max_blocks = max((context_lens[b] + block_size - 1) // block_size for b in members)
        q_len = torch.tensor([query_lens[b] for b in members])
        ctx_len = torch.tensor([context_lens[b] for b in members])
        start = torch.tensor([starts[b] for b in members])
        offs = torch.arange(max_q)
        valid = offs.unsqueeze(0) < q_len.unsqueeze(1)  # [B, Q]
        query_index = torch.where(valid, start.unsqueeze(1) + offs, 0)
        # Absolute position of query i is ctx_len - q_len + i; it sees every cached slot up to itself.
        q_pos = (ctx_len - q_len).unsqueeze(1) + offs  # [B, Q]
        kv_pos = torch.arange(max_blocks * block_size)
        mask = kv_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)
        mask |= (~valid).unsqueeze(2) & (kv_pos == 0)  # padded rows see slot 0 only, so softmax stays finite
        tables = torch.zeros(len(members), max_blocks, dtype=torch.long)
        for row, b in enumerate(members):
            n = (context_lens[b] + block_size - 1) // block_size
            tables[row, :n] = torch.tensor(block_tables[b][:n], dtype=torch.long)
        return AttentionGroup(
            query_index=query_index.to(device), block_tables=tables.to(device),
            mask=mask.unsqueeze(1).to(device), valid=valid.to(device), out_index=query_index[valid].to(device))


class PagedAttention(nn.Module):
    """Attention whose keys and values live in a paged pool ``[num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``q``: [T, heads, dim]; ``k``, ``v``: [T, kv_heads, dim]. Returns [T, heads * dim]."""
        self._store(k, v, meta.slot_mapping)
        if len(meta.groups) == 1:  # one group holds every sequence in order: no scatter needed
            return self._attend(q, meta.groups[0]).flatten(1)
        out = torch.empty_like(q)
        for group in meta.groups:
            out[group.out_index] = self._attend(q, group)
        return out.flatten(1)

    def _store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, v.to(flat_v.dtype))

    def _gather(self, cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, nb = tables.shape
        ctx = cache[tables].view(b, nb * cache.shape[1], self.num_kv_heads, self.head_dim)
        return ctx.transpose(1, 2).to(dtype)  # [B, kv_heads, L, dim]

    def _attend(self, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        decode = group.valid.shape[1] == 1  # one query per sequence, none padded
        if decode and group.query_index.shape[0] == q.shape[0]:
            query = q.unsqueeze(2)  # the whole batch is decode tokens in order: [B, heads, 1, dim]
        else:
            query = q[group.query_index].transpose(1, 2)  # [B, heads, Q, dim]
        key = self._gather(self.k_cache, group.block_tables, q.dtype)
        value = self._gather(self.v_cache, group.block_tables, q.dtype)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=group.mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2)  # [B, Q, heads, dim]
        return out.flatten(0, 1) if decode else out[group.valid]  # [n_valid, heads, dim]
