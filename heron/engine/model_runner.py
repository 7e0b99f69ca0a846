"""Runs one model forward over a flattened batch of token chunks and returns the logits that were asked for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.engine.sequence import Sequence
from heron.layers.attention import AttentionMetadata


@dataclass
class RunItem:
    """Compute ``num_new_tokens`` tokens of ``seq`` from its first uncomputed one and return the logits of the
    last ``num_logits`` of them (1 to sample; more to score prompt tokens or speculative proposals)."""

    seq: Sequence
    num_new_tokens: int
    num_logits: int


class ModelRunner:
    """Owns the model and its paged KV pool (one K and one V tensor per layer, allocated once)."""

    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_cache: torch.Tensor | None = None
        layers = model.attention_layers()
        self.num_layers = len(layers)
        self.num_kv_heads = layers[0].num_kv_heads
        self.head_dim = layers[0].head_dim

    def bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=kv_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """Allocate the pool once and hand each attention layer its slice."""
        shape = (2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def execute(self, items: list[RunItem]) -> torch.Tensor:
        """One forward pass; returns ``[sum(num_logits), vocab]`` float32 logits in item order."""
        input_ids, positions, slots, logits_index = [], [], [], []
        query_lens, context_lens, tables = [], [], []
        bs = self.block_size
        for item in items:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            logits_index.extend(range(len(input_ids) - item.num_logits, len(input_ids)))
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            tables.append(seq.block_table)
        meta = AttentionMetadata.build(query_lens, context_lens, tables, slots, bs, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, meta)
        index = torch.tensor(logits_index, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[index]).float()
