"""Every attention backend against dense attention, on a step that mixes what a real step can hold: a prefill
chunk over a cached prefix, decodes, several query tokens per sequence (speculative verification), GQA, and
sliding windows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from heron.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def dense_attention(q, k, v, window):
    """Causal (optionally windowed) attention of the last ``len(q)`` positions over all ``len(k)``, GQA."""
    n_q, n_k = q.shape[0], k.shape[0]
    q_pos = torch.arange(n_k - n_q, n_k).unsqueeze(1)
    k_pos = torch.arange(n_k).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def by_slot(pool: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
    """A pool's keys and values by slot, ``[2, slots, kv_heads, dim]``, in either backend's layout (the CPU
    kernel's pool is head-major, ``[2, blocks, kv_heads, block_size, dim]``)."""
    return (pool.transpose(2, 3) if backend.name == "cpu_paged" else pool).flatten(1, 2)


# (context already cached, new query tokens): a chunk over a cached prefix, decodes, verification queries,
# a fresh prompt, a chunk of more queries than the CPU kernel takes (the prefill path)
STEP = [(12, 9), (7, 1), (30, 1), (17, 5), (0, 6), (21, 1), (5, 20)]


@dataclass
class MixedStep:
    """One step of ``STEP`` whose cached contexts are already in the pool: the flat new queries, keys and values
    with their metadata, and per sequence its queries and all of its keys and values."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: AttentionMetadata
    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def dense(self, window: int | None, keys: list[torch.Tensor] | None = None,
              values: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Dense attention per sequence in float32, over its keys and values or (a lossy pool) the given ones."""
        return torch.cat([dense_attention(q.float(), k.float(), v.float(), window) for q, k, v in
                          zip(self.queries, keys or self.keys, values or self.values, strict=True)])


def mixed_step(backend: AttentionBackend, cache: torch.Tensor, dtype: torch.dtype, seed: int = 0,
               shape: list[tuple[int, int]] = STEP) -> MixedStep:
    """Random queries, keys and values of ``dtype`` for ``shape`` (``STEP``) over scattered blocks of ``cache``;
    the cached part of each context is stored through ``backend`` (as earlier steps would have)."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(cache.shape[1], generator=g).tolist()  # scattered blocks: tables are not contiguous
    tables, queries, keys, values, slots = [], [], [], [], []
    for cached, new in shape:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        tables.append(table)
        k = torch.randn(total, KV_HEADS, DIM, generator=g).to(dtype)
        v = torch.randn(total, KV_HEADS, DIM, generator=g).to(dtype)
        earlier = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached)], dtype=torch.long)
        backend.store_kv(cache, k[:cached], v[:cached], earlier)
        queries.append(torch.randn(new, HEADS, DIM, generator=g).to(dtype))
        keys.append(k)
        values.append(v)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
    query_lens = [new for _, new in shape]
    context_lens = [cached + new for cached, new in shape]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(starts, torch.tensor(context_lens, dtype=torch.int32), block_table,
                             torch.tensor(slots), query_lens, context_lens, BLOCK)
    new_k = torch.cat([k[cached:] for k, (cached, _) in zip(keys, shape, strict=True)])
    new_v = torch.cat([v[cached:] for v, (cached, _) in zip(values, shape, strict=True)])
    return MixedStep(torch.cat(queries), new_k, new_v, meta, queries, keys, values)


@pytest.mark.parametrize("backend_name", ["reference", "cpu_paged"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_equals_dense_attention_on_a_mixed_step(backend_name, window, dtype):
    backend = get_attention_backend(backend_name)
    cache = torch.zeros(backend.kv_cache_shape(64, BLOCK, KV_HEADS, DIM), dtype=dtype)
    step = mixed_step(backend, cache, dtype)
    backend.prepare(step.meta)
    out = backend.forward(step.q, step.k, step.v, cache, step.meta, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 output rounding
    torch.testing.assert_close(out.float(), step.dense(window), atol=tol, rtol=tol)


def test_cpu_paged_long_chunks_do_not_depend_on_their_companions():
    # chunks of more queries than the kernel takes go through SDPA: each in a call of its own shape, so its rows
    # are bit for bit those of the chunk alone (packed integer weights round activations to int8, and would grow
    # a last-bit difference into other logits)
    backend = get_attention_backend("cpu_paged")
    cache = torch.zeros(backend.kv_cache_shape(64, BLOCK, KV_HEADS, DIM))
    step = mixed_step(backend, cache, torch.float32, shape=[(0, 40), (9, 23), (0, 17), (30, 1)])
    backend.prepare(step.meta)
    together = backend.forward(step.q, step.k, step.v, cache, step.meta)
    meta, starts = step.meta, step.meta.query_start_loc.tolist()
    for b in range(meta.num_seqs):
        rows = slice(starts[b], starts[b + 1])
        alone = AttentionMetadata(torch.tensor([0, rows.stop - rows.start], dtype=torch.int32),
                                  meta.seq_lens[b:b + 1], meta.block_table[b:b + 1], meta.slot_mapping[rows],
                                  meta.query_lens[b:b + 1], meta.context_lens[b:b + 1], BLOCK)
        backend.prepare(alone)
        assert torch.equal(backend.forward(step.q[rows], step.k[rows], step.v[rows], cache, alone), together[rows])


def test_cpu_paged_long_chunks_gather_from_its_head_major_pool(monkeypatch):
    """Where the CPU has AMX, long bfloat16 prefill chunks of long sequences take gather + SDPA out of the
    kernel's head-major pool (``CpuPagedBackend._gather``): forced here whatever the CPU, against dense attention."""
    import heron.attention.cpu_paged as cpu_paged

    monkeypatch.setattr(cpu_paged, "cpu_flags", lambda: frozenset({"amx_tile", "amx_bf16"}))
    backend = get_attention_backend("cpu_paged")
    cache = torch.zeros(backend.kv_cache_shape(128, BLOCK, KV_HEADS, DIM), dtype=torch.bfloat16)
    # a chunk of 30 queries over 180 cached positions (longer than the kernel's share), a decode, a short prompt
    step = mixed_step(backend, cache, torch.bfloat16, shape=[(180, 30), (30, 1), (0, 40)])
    backend.prepare(step.meta)
    assert step.meta.backend_data["long"] == [0]
    out = backend.forward(step.q, step.k, step.v, cache, step.meta)
    torch.testing.assert_close(out.float(), step.dense(None), atol=2e-2, rtol=2e-2)
