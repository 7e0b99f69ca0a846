"""The reference backend: gather each sequence's context out of the pool, then one SDPA call per group.

Exact against transformers (1e-4 in float32) and simple, which is why it stays as the yardstick for faster
backends. Sequences with one query (decodes) form one group, the others (prefill chunks, verification
queries) another, padded to the longest and masked causally per sequence; a sliding window narrows the
mask to the last ``window`` positions. The gather copies every context each step: its cost grows with the
batch's contexts, which a paged kernel avoids. A float8 pool is dequantized as it is gathered
(``quantization/kv.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from heron.attention.backend import AttentionBackend, AttentionMetadata
from heron.quantization.kv import dequantize_kv, is_fp8, quantize_kv


@dataclass
class _Group:
    """Sequences attended in one SDPA call. ``query_index[b, i]`` is the flat index of b's i-th query
    (padding points at token 0); ``valid`` marks the real entries; ``q_pos`` their absolute positions."""

    query_index: torch.Tensor  # [B, Q] long
    block_table: torch.Tensor  # [B, max_blocks] long
    valid: torch.Tensor  # [B, Q] bool
    q_pos: torch.Tensor  # [B, Q] long
    out_index: torch.Tensor  # [n_valid] long
    in_order: bool  # one query each, covering the whole batch in order: no index/scatter needed
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, block_size: int, window: int | None) -> torch.Tensor:
        """``[B, 1, Q, L]``: query i of b sees context slot j iff ``q_pos - window < j <= q_pos``."""
        if window not in self.masks:
            kv_pos = torch.arange(self.block_table.shape[1] * block_size, device=self.q_pos.device)
            q_pos = self.q_pos.unsqueeze(2)
            mask = kv_pos.view(1, 1, -1) <= q_pos
            if window is not None:
                mask &= kv_pos.view(1, 1, -1) > q_pos - window
            mask |= (~self.valid).unsqueeze(2) & (kv_pos == 0)  # padded rows see slot 0: softmax stays finite
            self.masks[window] = mask.unsqueeze(1)
        return self.masks[window]


class ReferenceBackend(AttentionBackend):
    """Gather + PyTorch SDPA over a ``[2, num_blocks, block_size, kv_heads, head_dim]`` pool per layer."""

    name = "reference"
    supports_fp8_kv = True

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_cache[:, dst] = kv_cache[:, src]

    def prepare(self, meta: AttentionMetadata) -> None:
        decode = [b for b, q in enumerate(meta.query_lens) if q == 1]
        multi = [b for b, q in enumerate(meta.query_lens) if q > 1]
        meta.backend_data["groups"] = [self._group(meta, members) for members in (decode, multi) if members]

    @staticmethod
    def _group(meta: AttentionMetadata, members: list[int]) -> _Group:
        device = meta.slot_mapping.device
        rows = torch.tensor(members, dtype=torch.long)
        q_len = torch.tensor([meta.query_lens[b] for b in members])
        ctx_len = torch.tensor([meta.context_lens[b] for b in members])
        start = meta.query_start_loc.cpu().long()[rows]
        max_q = int(q_len.max())
        max_blocks = -(-int(ctx_len.max()) // meta.block_size)
        offs = torch.arange(max_q)
        valid = offs.unsqueeze(0) < q_len.unsqueeze(1)
        query_index = torch.where(valid, start.unsqueeze(1) + offs, 0)
        q_pos = (ctx_len - q_len).unsqueeze(1) + offs  # absolute position of each query
        table = meta.block_table[rows.to(meta.block_table.device), :max_blocks].long()
        in_order = max_q == 1 and len(members) == meta.num_seqs
        return _Group(query_index.to(device), table, valid.to(device), q_pos.to(device),
                      query_index[valid].to(device), in_order)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        self.store_kv(kv_cache, k, v, meta.slot_mapping)
        groups = meta.backend_data["groups"]
        if len(groups) == 1 and (groups[0].in_order or groups[0].out_index.shape[0] == q.shape[0]):
            return self._attend(q, kv_cache, groups[0], meta.block_size, sliding_window)
        out = torch.empty_like(q)
        for group in groups:
            out[group.out_index] = self._attend(q, kv_cache, group, meta.block_size, sliding_window)
        return out

    def store_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        scales = self.scales_to_store(k, v)
        k, v = quantize_kv(k, kv_cache.dtype, scales.k), quantize_kv(v, kv_cache.dtype, scales.v)
        flat = kv_cache.flatten(1, 2)  # [2, slots, kv_heads, dim]
        if is_fp8(kv_cache.dtype):  # index_copy_ has no float8 kernel on the CPU: copy the bytes
            flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)

    @staticmethod
    def _gather(cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
        b, nb = table.shape
        ctx = cache[table].view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3])
        return dequantize_kv(ctx.transpose(1, 2), dtype, scale)  # [B, kv_heads, L, dim]

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, group: _Group, block_size: int,
                window: int | None) -> torch.Tensor:
        if group.in_order:
            query = q.unsqueeze(2)  # [B, heads, 1, dim]
        else:
            query = q[group.query_index].transpose(1, 2)  # [B, heads, Q, dim]
        key = self._gather(kv_cache[0], group.block_table, q.dtype, self.kv_scales.k)
        value = self._gather(kv_cache[1], group.block_table, q.dtype, self.kv_scales.v)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=group.mask(block_size, window),
                                             enable_gqa=query.shape[1] != key.shape[1])
        out = out.transpose(1, 2)  # [B, Q, heads, dim]
        return out.flatten(0, 1) if group.in_order else out[group.valid]
