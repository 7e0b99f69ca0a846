"""Every attention backend against dense attention, on a step that mixes what a real step can hold: a prefill
chunk over a cached prefix, decodes, several query tokens per sequence (speculative verification), GQA, and
sliding windows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heron.attention.backend import AttentionMetadata, get_attention_backend

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def dense_attention(q, k, v, window):
    """Causal (optionally windowed) attention of the last ``len(q)`` positions over all ``len(k)``."""
    n_q, n_k = q.shape[0], k.shape[0]
    q_pos = torch.arange(n_k - n_q, n_k).unsqueeze(1)
    k_pos = torch.arange(n_k).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


# (context already cached, new query tokens): a chunk over a cached prefix, decodes, verification queries,
# a fresh prompt, a chunk of more queries than the CPU kernel takes (the prefill path)
STEP = [(12, 9), (7, 1), (30, 1), (17, 5), (0, 6), (21, 1), (5, 20)]


@pytest.mark.parametrize("backend_name", ["reference", "cpu_paged"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_equals_dense_attention_on_a_mixed_step(backend_name, window, dtype):
    g = torch.Generator().manual_seed(0)
    backend = get_attention_backend(backend_name)
    num_blocks = 64
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, BLOCK, KV_HEADS, DIM), dtype=dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks: tables are not contiguous
    tables, full_k, full_v = [], [], []
    q_parts, k_parts, v_parts, slots, query_lens, context_lens = [], [], [], [], [], []
    for cached, new in STEP:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        tables.append(table)
        k = torch.randn(total, KV_HEADS, DIM, generator=g).to(dtype)
        v = torch.randn(total, KV_HEADS, DIM, generator=g).to(dtype)
        full_k.append(k)
        full_v.append(v)
        earlier = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached)], dtype=torch.long)
        backend.store_kv(cache, k[:cached], v[:cached], earlier)  # what earlier steps stored
        q_parts.append(torch.randn(new, HEADS, DIM, generator=g).to(dtype))
        k_parts.append(k[cached:])
        v_parts.append(v[cached:])
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
        query_lens.append(new)
        context_lens.append(total)
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(starts, torch.tensor(context_lens, dtype=torch.int32), block_table,
                             torch.tensor(slots), query_lens, context_lens, BLOCK)
    backend.prepare(meta)
    out = backend.forward(torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), cache, meta, window)
    expected = torch.cat([dense_attention(q.float(), k.float(), v.float(), window)
                          for q, k, v in zip(q_parts, full_k, full_v, strict=True)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 output rounding
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
