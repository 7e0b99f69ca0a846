"""The CPU paged backend: a C++ kernel reads keys and values in place through the block table.

The kernel's cost grows with the positions each query attends, not with the batch's longest context, and it
never gathers a context into a new tensor. A row's arithmetic depends on its position only, so its result is
the same bit for bit whatever else the step holds and however its prompt was chunked or found in the prefix
cache (with packed integer weights, whose activations are rounded to int8, a last-bit difference can grow into
another token). In float32 every query goes through it: on an AVX2 CPU it measured faster than gather + SDPA
at every chunk shape tried, up to 2,048 queries over 2,048 positions (docs/performance.md), and so it does in half
precision on a CPU without AMX (Zen 4: prefill 1.3-1.9x that of SDPA). Where the CPU has AMX, the sequences with
few queries this step (decodes, speculative verification: at most ``MAX_KERNEL_QUERIES``) or a short context (at
most ``MAX_KERNEL_CONTEXT`` positions: a short prompt, whose step then stays in the decoder stack) go through it,
and long prefill chunks of longer sequences take the reference path (gather + SDPA, whose bfloat16 GEMMs run on
AMX tiles: 1.1-1.7x the kernel there), one SDPA call per chunk so that a chunk's result does not depend on the
shapes of the others in its step. The kernel is part of heron's CPU extension (heron/kernels), built at first use;
without a compiler the engine falls back to the reference backend with one warning. A float8 pool is written
and read by the kernels too: the queries and the output keep the model's dtype, and the layer's key scale is
folded into the queries, its value scale into the output.
"""

from __future__ import annotations

import torch

from heron.attention.backend import AttentionMetadata
from heron.attention.reference import ReferenceBackend, _Group
from heron.cpu import cpu_flags
from heron.kernels import load_cpu_kernels
from heron.quantization.kv import dequantize_kv

MAX_KERNEL_QUERIES = 16
# Where long chunks take SDPA: sequences up to this many positions still take the kernel. Prefill of 128-token
# prompts measured 1.13x faster through the kernel on an Intel Xeon VM with AMX, of 256-token ones 0.88x
# (docs/performance.md).
MAX_KERNEL_CONTEXT = 192


def kernel_takes(query_len: int, seq_len: int) -> bool:
    """Whether a sequence's queries of a step go through the kernel where long chunks take SDPA: few queries,
    or a short context. It depends on the sequence alone, so a prompt found in the prefix cache or cut into
    other chunks still takes the same path as long as it stays short."""
    return query_len <= MAX_KERNEL_QUERIES or seq_len <= MAX_KERNEL_CONTEXT


def kernel_takes_every_query(dtype: torch.dtype) -> bool:
    """Whether every query of a step goes through the kernel in ``dtype`` (see the module docstring): in float32,
    and in half precision where the CPU has no AMX tiles for SDPA's GEMMs."""
    return dtype == torch.float32 or "amx_bf16" not in cpu_flags()


class CpuPagedBackend(ReferenceBackend):
    """Queries through the C++ kernel (all of them, or on AMX CPUs in half precision those ``kernel_takes``),
    the other prefill chunks through the reference path. Its pool is head-major, ``[2, num_blocks, kv_heads,
    block_size, head_dim]``: a KV head's positions of a block lie together, so the kernel reads a tile of one
    head as one run of memory instead of a slice of every position's row."""

    name = "cpu_paged"

    def __init__(self) -> None:
        self.kernel = load_cpu_kernels()

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_dim)

    @staticmethod
    def _gather(cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
        b, nb = table.shape
        ctx = cache[table].transpose(1, 2).reshape(b, cache.shape[1], nb * cache.shape[2], cache.shape[3])
        return dequantize_kv(ctx, dtype, scale)  # [B, kv_heads, L, dim]

    def prepare(self, meta: AttentionMetadata) -> None:
        takes = [kernel_takes(q, n) for q, n in zip(meta.query_lens, meta.context_lens, strict=True)]
        starts = meta.query_start_loc.cpu().to(torch.int32)
        begin, end = starts[:-1].clone(), starts[1:].clone()
        meta.backend_data["kernel"] = (begin, end)  # every query (kernel_takes_every_query)
        meta.backend_data["kernel_share"] = (begin, torch.where(torch.tensor(takes), end, begin))  # kernel_takes
        meta.backend_data["long"] = [b for b, t in enumerate(takes) if not t]

    @staticmethod
    def kernel_queries(meta: AttentionMetadata, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (begin, end) query ranges of the kernel when it takes every query of a step prepared by this
        backend, in ``dtype``; None when some go another way (or another backend prepared the step)."""
        data = meta.backend_data
        if "kernel" not in data:
            return None
        if kernel_takes_every_query(dtype):
            return data["kernel"]
        return None if data["long"] else data["kernel_share"]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        self.store_kv(kv_cache, k, v, meta.slot_mapping)
        every_query = kernel_takes_every_query(q.dtype)
        begin, end = meta.backend_data["kernel" if every_query else "kernel_share"]
        out = self.kernel.paged_attention(q, kv_cache, meta.block_table, meta.seq_lens, begin, end,
                                          q.shape[-1] ** -0.5, sliding_window or 0, self.kv_scales.k,
                                          self.kv_scales.v)
        if not every_query:
            for group in self._long_chunks(meta):
                out[group.out_index] = self._attend(q, kv_cache, group, meta.block_size, sliding_window)
        return out

    def _long_chunks(self, meta: AttentionMetadata) -> list[_Group]:
        """One SDPA group per long chunk, of its own shape (padded beside others, its result would depend on
        them); built by the step's first layer that needs them."""
        if "groups" not in meta.backend_data:
            meta.backend_data["groups"] = [self._group(meta, [b]) for b in meta.backend_data["long"]]
        return meta.backend_data["groups"]

    def store_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        scales = self.scales_to_store(k, v)
        self.kernel.store_kv(k, v, kv_cache, slots, scales.k, scales.v)
