"""The CPU paged-attention kernel on the shapes its fast paths take: all of a sequence's queries of one KV head
walk its context together (speculative verification), row-vectors of many query rows or a few (decode), head
dims compiled in (64, 128) or not, contexts split over threads and merged, windows, fp8 pools; each against
dense attention in float32."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from heron.kernels import cpu_kernels

from .test_backends import dense_attention

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="heron's CPU kernels cannot be built here")


def head_major(pool: torch.Tensor) -> torch.Tensor:
    """A pool built by slot, ``[2, blocks, block_size, kv_heads, dim]``, in the kernel's head-major layout,
    ``[2, blocks, kv_heads, block_size, dim]``."""
    return pool.transpose(2, 3).contiguous()


def attend(seqs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, block: int, dtype: torch.dtype,
           window: int | None, pool_dtype: torch.dtype | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
           seed: int = 0, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and dense attention's for sequences of (context length, new queries) over scattered
    blocks of one pool; the pool holds ``pool_dtype`` (keys / k_scale and values / v_scale), ``fill`` in the
    slots no sequence wrote."""
    g = torch.Generator().manual_seed(seed)
    pool_dtype = pool_dtype or dtype
    num_blocks = sum(-(-length // block) for length, _ in seqs) + 2
    pool = torch.full((2, num_blocks, block, kv_heads, dim), fill, dtype=pool_dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, queries, expected = [], [], []
    for length, new in seqs:
        table = [free.pop() for _ in range(-(-length // block))]
        tables.append(table)
        k = (torch.randn(length, kv_heads, dim, generator=g) / k_scale).to(pool_dtype)
        v = (torch.randn(length, kv_heads, dim, generator=g) / v_scale).to(pool_dtype)
        slots = torch.tensor([table[p // block] * block + p % block for p in range(length)], dtype=torch.long)
        pool[0].view(-1, kv_heads, dim)[slots] = k
        pool[1].view(-1, kv_heads, dim)[slots] = v
        q = torch.randn(new, heads, dim, generator=g).to(dtype)
        queries.append(q)
        expected.append(dense_attention(q.float(), k.float() * k_scale, v.float() * v_scale, window))
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor([length for length, _ in seqs], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor([new for _, new in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    out = cpu_kernels().paged_attention(torch.cat(queries), head_major(pool), block_table, lens, starts[:-1],
                                        starts[1:], dim**-0.5, window or 0, k_scale, v_scale)
    return out, torch.cat(expected)


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"{n}threads")
def threads(request):
    """1 thread: whole units; more: a few units' contexts split into parts and merged."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


# (context length, new queries): a decode, verification steps, a short context, a sequence of more queries than
# one unit takes, a fresh prompt
STEPS = {
    "decode": [(300, 1)],
    "verify": [(300, 8)],
    "mixed": [(97, 5), (5, 5), (130, 1), (17, 16), (40, 2)],
    "long": [(70, 40)],
    "tiny": [(3, 1), (1, 1), (6, 6)],
}


@needs_kernels
@pytest.mark.parametrize("step", STEPS, ids=list(STEPS))
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 1, 128), (4, 4, 64), (32, 4, 8), (6, 2, 40)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window", [None, 37])
def test_kernel_equals_dense_attention_in_float32(threads, step, shape, window):
    heads, kv_heads, dim = shape
    out, expected = attend(STEPS[step], heads, kv_heads, dim, 16, torch.float32, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("block", [4, 32])  # tiles of 16 positions span several blocks, or part of one
@pytest.mark.parametrize("window", [None, 5])
def test_tiles_across_block_boundaries(threads, block, window):
    out, expected = attend(STEPS["mixed"] + STEPS["verify"], 9, 3, 64, block, torch.float32, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("block", [16, 32, 4])
def test_unwritten_slots_are_never_read(threads, block):
    """A float32 pool is read in place a tile at a time, the slots past a sequence's end included: what they hold
    (NaN here, as a freed block may) must not reach any row's output."""
    out, expected = attend(STEPS["mixed"] + STEPS["tiny"], 9, 3, 64, block, torch.float32, None, fill=float("nan"))
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128, 24])
def test_half_precision_queries_and_pool(threads, dtype, dim):
    out, expected = attend(STEPS["mixed"] + STEPS["verify"], 9, 3, dim, 16, dtype, 11)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_kernels
@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dim", [64, 40])
def test_fp8_pool_with_scales(threads, pool_dtype, dim):
    """The keys and values dense attention sees are the pool's, dequantized: only float rounding differs."""
    out, expected = attend(STEPS["mixed"] + STEPS["verify"], 9, 3, dim, 16, torch.float32, None, pool_dtype,
                           k_scale=0.05, v_scale=0.02)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_split_contexts_equal_whole_ones():
    """Parts merged by log-sum-exp give what one pass over the context gives, to float rounding."""
    old = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            outs.append(attend([(1000, 1), (777, 7)], 9, 3, 64, 16, torch.float32, None)[0])
    finally:
        torch.set_num_threads(old)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-5)


@needs_kernels
def test_a_sequence_without_queries_is_skipped():
    """An empty query range (a sequence the prefill path takes) leaves its rows alone and costs nothing."""
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 4, 16, 3, 64, generator=g)
    q = torch.randn(3, 9, 64, generator=g)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    out = cpu_kernels().paged_attention(q, head_major(pool), table, lens, torch.tensor([0, 1], dtype=torch.int32),
                                        torch.tensor([1, 1], dtype=torch.int32), 0.125, 0)
    k = pool[0].reshape(-1, 3, 64)[:20]
    v = pool[1].reshape(-1, 3, 64)[:20]
    torch.testing.assert_close(out[:1], dense_attention(q[:1], k, v, None), atol=1e-5, rtol=1e-5)


@needs_kernels
def test_a_pool_that_does_not_fit_the_queries_is_an_error():
    q = torch.randn(1, 9, 64)
    table, lens, begin = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                          torch.zeros(1, dtype=torch.int32))
    for pool in (torch.zeros(2, 4, 2, 16, 64), torch.zeros(2, 4, 3, 16, 32), torch.zeros(4, 16, 3, 64)):
        with pytest.raises(RuntimeError, match="a pool"):
            cpu_kernels().paged_attention(q, pool, table, lens, begin, begin + 1, 0.125, 0, 1.0, 1.0)


def run_kernel(seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block: int = 16) -> list[torch.Tensor]:
    """The kernel's output for each sequence's (keys, values, queries of its last positions), blocks scattered."""
    kv_heads, dim = seqs[0][0].shape[1:]
    num_blocks = sum(-(-len(k) // block) for k, _, _ in seqs)
    pool = torch.zeros(2, num_blocks, block, kv_heads, dim, dtype=seqs[0][0].dtype)
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(len(seqs))).tolist()
    tables = []
    for k, v, _ in seqs:
        tables.append([free.pop() for _ in range(-(-len(k) // block))])
        slots = torch.tensor([tables[-1][p // block] * block + p % block for p in range(len(k))])
        pool[0].view(-1, kv_heads, dim)[slots] = k
        pool[1].view(-1, kv_heads, dim)[slots] = v
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor([len(k) for k, _, _ in seqs], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor([len(q) for _, _, q in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    out = cpu_kernels().paged_attention(torch.cat([q for _, _, q in seqs]), head_major(pool), table, lens,
                                        starts[:-1], starts[1:], dim**-0.5, 0, 1.0, 1.0)
    return list(out.split([len(q) for _, _, q in seqs]))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_query_row_is_bitwise_the_same_whatever_else_the_step_holds(threads, dtype):
    """Batch invariance, which speculative decoding's identical greedy output rests on: each query of a
    verification step (8 queries of one sequence, alone or beside other sequences) equals, bit for bit, the same
    query decoded alone at its position."""
    g = torch.Generator().manual_seed(5)

    def data(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(torch.randn(length, heads, 64, generator=g).to(dtype) for heads in (3, 3, 9))

    k, v, q = data(300)
    decodes = [run_kernel([(k[:p + 1], v[:p + 1], q[p:p + 1])])[0] for p in range(292, 300)]
    verify = run_kernel([(k, v, q[292:])])[0]
    others = [data(n) for n in (41, 130, 17)]
    in_batch = run_kernel([(a, b, c[-3:]) for a, b, c in others[:1]] + [(k, v, q[292:])]
                          + [(a, b, c[-n:]) for (a, b, c), n in zip(others[1:], (1, 16), strict=True)])[1]
    assert torch.equal(torch.cat(decodes), verify)
    assert torch.equal(in_batch, verify)


@needs_kernels
@pytest.mark.parametrize("window", [None, 37], ids=["no_window", "window37"])
def test_a_query_row_is_bitwise_the_same_across_threads_windows_and_prefill_chunks(window):
    """The same invariance under a sliding window, at any thread count (1: whole units; more: a few units' chunks
    spread over threads), and for a prefill chunk's queries (several units of them) or a batch of decodes, each
    against the query decoded alone on one thread."""
    g = torch.Generator().manual_seed(7)
    length, block = 200, 16
    k, v, q = (torch.randn(length, heads, 64, generator=g).to(torch.bfloat16) for heads in (3, 3, 9))
    num_blocks = -(-length // block)
    table = torch.randperm(num_blocks, generator=g).to(torch.int32)
    pool = torch.zeros(2, num_blocks, block, 3, 64, dtype=torch.bfloat16)
    slots = table.long()[torch.arange(length) // block] * block + torch.arange(length) % block
    pool[0].view(-1, 3, 64)[slots] = k
    pool[1].view(-1, 3, 64)[slots] = v
    pool = head_major(pool)

    def run(steps: list[tuple[int, int]], threads: int) -> list[torch.Tensor]:
        """(sequence length, new queries) per sequence, all of them over the same blocks."""
        lens = torch.tensor([n for n, _ in steps], dtype=torch.int32)
        starts = torch.tensor([0, *torch.tensor([m for _, m in steps]).cumsum(0).tolist()], dtype=torch.int32)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = cpu_kernels().paged_attention(torch.cat([q[n - m:n] for n, m in steps]), pool,
                                                table.repeat(len(steps), 1), lens, starts[:-1], starts[1:],
                                                0.125, window or 0, 1.0, 1.0)
        finally:
            torch.set_num_threads(old)
        return list(out.split([m for _, m in steps]))

    alone = torch.cat([run([(p + 1, 1)], 1)[0] for p in range(150, length)])
    for threads in (1, 2, 3):
        assert torch.equal(torch.cat(run([(p + 1, 1) for p in range(150, length)], threads)), alone)
        assert torch.equal(run([(length, 50)], threads)[0], alone)
        assert torch.equal(run([(30, 7), (length, 50), (170, 3)], threads)[1], alone)
        assert torch.equal(run([(length - 40, 10), (length, 40)], threads)[1], alone[10:])


@needs_kernels
@pytest.mark.parametrize("pairs", ["0", "1"])
def test_bfloat16_scores_either_way(pairs):
    """bfloat16 scores from VDPBF16PS pairs (AMD) or from float32 FMAs (Intel), as HERON_BF16_PAIRS forces either
    on any CPU: both against dense attention and bit for bit across batches. The choice is read once a process,
    so each runs this file's bfloat16 tests in a process of its own."""
    env = {**os.environ, "HERON_BF16_PAIRS": pairs}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "(bfloat16 or bitwise) and not either_way"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout
