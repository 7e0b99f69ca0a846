"""The shared-memory all-reduce: every rank gets the same bits, the sum of the ranks' tensors, over many calls
(the two slot sets alternating); a rank waiting on a dead peer gives up once it is declared dead."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from heron.distributed import shm_all_reduce
from heron.distributed.shm_all_reduce import ShmAllReduce

pytestmark = pytest.mark.skipif(not shm_all_reduce.supported(), reason="x86 with /dev/shm only")

SHAPES = [(1, 576), (7, 64), (3, 5, 16), (1,)]


def tensors(rank: int, call: int, dtype: torch.dtype) -> torch.Tensor:
    shape = SHAPES[call % len(SHAPES)]
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * call + rank)).to(dtype)


def run_rank(path: str, rank: int, size: int, calls: int, dtype: torch.dtype, op: str, out) -> None:
    shm = ShmAllReduce(path, rank, size, timeout=30)
    # as lists: a tensor put in a queue would be shared through a file descriptor this process takes along
    out.put((rank, [getattr(shm, op)(tensors(rank, call, dtype)).float().tolist() for call in range(calls)]))


def run_ranks(tmp_path, size: int, calls: int, dtype: torch.dtype, op: str) -> dict[int, list]:
    """Each rank's results of ``calls`` calls of ``op``, from ``size`` processes sharing one segment."""
    path = str(tmp_path / "segment")
    ShmAllReduce.create(path, size)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(path, rank, size, calls, dtype, op, out)) for rank in range(size)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return results


@pytest.mark.parametrize("size, dtype", [(2, torch.float32), (3, torch.bfloat16)])
def test_every_rank_gets_the_sum(size, dtype, tmp_path):
    results = run_ranks(tmp_path, size, 40, dtype, "all_reduce")
    for call in range(40):
        expected = sum(tensors(rank, call, dtype).float() for rank in range(size)).to(dtype)
        for rank in range(size):
            assert results[rank][call] == results[0][call]  # the same bits everywhere
        torch.testing.assert_close(torch.tensor(results[0][call]).to(dtype), expected)


def test_abort_ends_a_wait_on_a_dead_peer(tmp_path):
    path = str(tmp_path / "segment")
    ShmAllReduce.create(path, 2)
    waiting, peer = ShmAllReduce(path, 0, 2, timeout=30), ShmAllReduce(path, 1, 2, timeout=30)
    peer.abort()  # what rank 0's watcher does when rank 1's process dies
    with pytest.raises(RuntimeError, match="a tensor-parallel rank died"):
        waiting.all_reduce(torch.ones(4))


def test_gather_gives_rank_0_every_part_in_rank_order(tmp_path):
    results = run_ranks(tmp_path, 2, 8, torch.float32, "gather_last_dim")
    for call in range(8):
        parts = [tensors(rank, call, torch.float32) for rank in range(2)]
        assert torch.equal(torch.tensor(results[0][call]), torch.cat(parts, dim=-1))
        assert torch.equal(torch.tensor(results[1][call]), parts[1])
