"""Paged attention in Triton, for CUDA: queries read their keys and values in place through the block table.

One program takes one sequence's block of queries under one KV head (``BLOCK_Q`` queries x the ``GROUP`` query
heads sharing that KV head: the rows of its score tiles) and walks the sequence's context ``TILE_N`` positions at
a time, each position's pool slot looked up through the block table (so the tile size does not depend on the
block size), with an online softmax in float32. Decodes, prefill chunks over a cached prefix and speculative
verification rows are the same program with different query counts; its work grows with the positions its
queries attend, not with the batch's longest context (as vLLM's Triton "unified attention" kernel).

It shares the reference backend's pool layout, KV writes and block copies; only the attention itself differs.
Not yet run on a GPU: the tests run it in Triton's interpreter (``TRITON_INTERPRET=1``) on the CPU against dense
attention and the reference backend, in float32 and float16 (the interpreter's bfloat16 dot products are
broken), which checks its indexing, masking and softmax but not its compilation for a GPU;
``benchmarks/gpu_check.sh`` does that where a GPU is lent. So ``auto`` keeps the reference backend on CUDA until
then, and a float8 pool is not read here yet.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from heron.attention.backend import AttentionMetadata
from heron.attention.reference import ReferenceBackend
from heron.errors import ConfigError

DECODE_ROWS = 16  # score-tile rows of a step whose sequences have one query each (the tile's smallest height)
PREFILL_ROWS = 64  # score-tile rows where some sequence has several queries
TILE_N = 32  # context positions per tile
ONLY_CUDA = "the triton_paged attention backend runs on CUDA (on the CPU only in Triton's interpreter, TRITON_INTERPRET=1)"


def interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (the only way this backend takes CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def paged_attention_kernel():
    """The jitted kernel, built on first use (heron imports without Triton). Triton reads ``TRITON_INTERPRET``
    when it is first imported."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention(out_ptr, q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, scale, window,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kp, stride_kh, stride_bt,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, PAGE: tl.constexpr,
                        WINDOWED: tl.constexpr, IEEE: tl.constexpr):
        seq = tl.program_id(0)
        q_block = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_start = tl.load(query_start_ptr + seq).to(tl.int64)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        if q_block * BLOCK_Q < q_len:
            first_pos = tl.load(seq_lens_ptr + seq) - q_len  # position of the sequence's first query
            rows = tl.arange(0, BLOCK_M)
            q_idx = q_block * BLOCK_Q + rows // GROUP
            head = kv_head * GROUP + rows % GROUP
            row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
            q_pos = first_pos + q_idx
            dims = tl.arange(0, HEAD_DIM_P)
            dim_ok = dims < HEAD_DIM
            io_mask = row_ok[:, None] & dim_ok[None, :]
            q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                        mask=io_mask, other=0.0)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
            last_pos = first_pos + tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1  # this block's last query
            lo = 0
            if WINDOWED:  # tiles wholly before every query's window are skipped
                lo = tl.maximum(first_pos + q_block * BLOCK_Q - window + 1, 0) // TILE * TILE
            for start in range(lo, last_pos + 1, TILE):
                pos = start + tl.arange(0, TILE)
                pos_ok = pos <= last_pos
                page = tl.load(block_table_ptr + seq * stride_bt + pos // PAGE, mask=pos_ok, other=0)
                slot = page.to(tl.int64) * stride_kb + (pos % PAGE) * stride_kp + kv_head * stride_kh
                kv_mask = pos_ok[:, None] & dim_ok[None, :]
                k = tl.load(k_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
                if IEEE:  # float32: no TF32 rounding of the products
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                seen = pos[None, :] <= q_pos[:, None]
                if WINDOWED:
                    seen = seen & (pos[None, :] > q_pos[:, None] - window)
                s = tl.where(seen, s * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=io_mask)

    return paged_attention


def triton_available() -> bool:
    """Whether Triton imports here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class TritonPagedBackend(ReferenceBackend):
    """The reference backend's ``[2, num_blocks, block_size, kv_heads, head_dim]`` pool, attended by the Triton
    kernel above (CUDA tensors, or CPU tensors in Triton's interpreter)."""

    name = "triton_paged"
    supports_fp8_kv = False

    def __init__(self) -> None:
        if not triton_available():
            raise ConfigError("the triton_paged attention backend needs Triton (pip install triton)")

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_data["max_query_len"] = max(meta.query_lens, default=0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        self.store_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        max_q = meta.backend_data["max_query_len"]
        if max_q == 0:
            return out
        if not q.is_cuda and not interpreted():
            raise RuntimeError(ONLY_CUDA)
        from triton import next_power_of_2

        heads, head_dim = q.shape[1], q.shape[2]
        group = heads // kv_cache.shape[3]
        block_m = max(DECODE_ROWS if max_q == 1 else PREFILL_ROWS, next_power_of_2(group))
        block_q = block_m // group
        keys, values = kv_cache[0], kv_cache[1]
        assert q.stride(2) == 1 and keys.stride(3) == 1, "the kernel reads rows of contiguous head dims"
        grid = (meta.num_seqs, -(-max_q // block_q), kv_cache.shape[3])
        paged_attention_kernel()[grid](
            out, q, keys, values, meta.block_table, meta.seq_lens, meta.query_start_loc,
            1.0 / math.sqrt(head_dim), sliding_window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            meta.block_table.stride(0),
            HEAD_DIM=head_dim, HEAD_DIM_P=max(16, next_power_of_2(head_dim)), GROUP=group, BLOCK_Q=block_q,
            BLOCK_M=block_m, TILE=TILE_N, PAGE=meta.block_size, WINDOWED=sliding_window is not None,
            IEEE=q.dtype == torch.float32)
        return out
