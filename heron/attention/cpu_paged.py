"""The CPU paged backend: a C++ kernel reads keys and values in place through the block table.

Sequences with few queries this step (decodes, speculative verification: at most ``MAX_KERNEL_QUERIES``) go
through the kernel, whose cost grows with the positions each query attends, not with the batch's longest
context, and which never gathers a context into a new tensor. Long prefill chunks stay on the reference path
(gather + SDPA), where a blocked matmul beats a per-query loop: one SDPA call per chunk, so that a chunk's
result does not depend on the shapes of the others in its step (with packed integer weights, whose activations
are rounded to int8, any last-bit difference grows into different logits: batched prefill then equals one at a
time, as long as the token budget cuts the prompt into the same chunks). The kernel is part of heron's CPU extension
(heron/kernels), built at first use; without a compiler the engine falls back to the reference backend with one
warning. A float8 pool is written and read by the kernels too: the queries and the output keep the model's
dtype, and the layer's key scale is folded into the queries, its value scale into the output.
"""

from __future__ import annotations

import torch

from heron.attention.backend import AttentionMetadata
from heron.attention.reference import ReferenceBackend
from heron.kernels import load_cpu_kernels

MAX_KERNEL_QUERIES = 16


class CpuPagedBackend(ReferenceBackend):
    """The reference layout and prefill path, with decode/verification queries through the C++ kernel."""

    name = "cpu_paged"

    def __init__(self) -> None:
        self.kernel = load_cpu_kernels()

    def prepare(self, meta: AttentionMetadata) -> None:
        few = [q <= MAX_KERNEL_QUERIES for q in meta.query_lens]
        starts = meta.query_start_loc.cpu()
        begin = starts[:-1].clone()
        end = torch.where(torch.tensor(few), starts[1:], begin)
        meta.backend_data["kernel"] = (begin.to(torch.int32), end.to(torch.int32), all(few))
        # one SDPA call per long chunk, of its own shape: padded beside others, its result would depend on them
        meta.backend_data["groups"] = [self._group(meta, [b]) for b, f in enumerate(few) if not f]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        self.store_kv(kv_cache, k, v, meta.slot_mapping)
        begin, end, _ = meta.backend_data["kernel"]
        out = self.kernel.paged_attention(q, kv_cache, meta.block_table, meta.seq_lens, begin, end,
                                          q.shape[-1] ** -0.5, sliding_window or 0, self.kv_scales.k,
                                          self.kv_scales.v)
        for group in meta.backend_data["groups"]:
            out[group.out_index] = self._attend(q, kv_cache, group, meta.block_size, sliding_window)
        return out

    def store_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        scales = self.scales_to_store(k, v)
        self.kernel.store_kv(k, v, kv_cache, slots, scales.k, scales.v)
