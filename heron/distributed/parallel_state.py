"""This process's place among the tensor-parallel ranks, and the collectives the sharded layers use.

Two process groups join the ranks: the default one (gloo on the CPU, NCCL on CUDA) for the model's collectives
(all-reduce after a row-parallel layer, the LM head's gather), with a timeout that bounds a stuck step, and a
gloo *control* group over which rank 0 (the engine core) can broadcast each runner call to the other ranks (the
Ray executor's channel; the processes of one machine take pipes, which are faster). The control group's timeout
is a year: an idle server's workers wait in it between requests. A rank that dies closes its sockets, so its
peers' pending collectives fail at once ("Connection closed by peer") instead of waiting out a timeout.

Ranks that are processes of one machine sum (and gather) small tensors (a decode step's activations and
logits) through shared memory instead (``shm_all_reduce.py``); larger ones, and ranks on several machines, through the process group.

With one rank (the default) nothing is initialised and every collective is the identity.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from heron.distributed.shm_all_reduce import ShmAllReduce
from heron.errors import ConfigError

STEP_TIMEOUT = datetime.timedelta(minutes=5)  # a collective waiting longer than this means a stuck rank
IDLE_TIMEOUT = datetime.timedelta(days=365)  # workers wait for rank 0's next call as long as the server idles


@dataclass
class TensorParallelGroup:
    """Rank and size of this process's tensor-parallel group; ``control`` is the group commands go through."""

    rank: int = 0
    size: int = 1
    control: Any = None
    shm: ShmAllReduce | None = None  # ranks of one machine: small all-reduces through shared memory

    def part(self, count: int | None = None) -> tuple[int, int]:
        """Which of ``count`` (default: one per rank) equal parts of a sharded axis this rank holds, as
        (index, count); with fewer parts than ranks (KV heads) consecutive ranks share a part."""
        count = count or self.size
        return self.rank * count // self.size, count


_group = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    """This process's tensor-parallel group (rank 0 of 1 unless ``init_tensor_parallel`` ran)."""
    return _group


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str = "gloo",
                         shm_path: str | None = None) -> None:
    """Join ranks ``0..size-1`` (blocks until every rank has called this); with ``shm_path`` (a segment rank 0
    created), small all-reduces go through it."""
    global _group
    if dist.is_initialized():
        raise ConfigError("torch.distributed is already initialised in this process (another engine with "
                          "tensor parallelism still running? stop it first: llm.engine.shutdown()); heron's "
                          "tensor parallelism starts its own process group")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=STEP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    shm = ShmAllReduce(shm_path, rank, size, STEP_TIMEOUT.total_seconds()) if shm_path else None
    _group = TensorParallelGroup(rank, size, control, shm)


def destroy_tensor_parallel() -> None:
    """Leave the process group (so another engine may start one in this process)."""
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns it."""
    if _group.size == 1:
        return x
    if _group.shm is not None and _group.shm.fits(x):
        return _group.shm.all_reduce(x)
    dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Rank 0 gets every rank's ``x`` concatenated along the last axis; the other ranks get their own back."""
    if _group.size == 1:
        return x
    x = x.contiguous()
    if _group.shm is not None and _group.shm.fits(x):
        return _group.shm.gather_last_dim(x)
    parts = [torch.empty_like(x) for _ in range(_group.size)] if _group.rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else x


def send_command(command: Any) -> None:
    """Rank 0: broadcast a picklable command to the other ranks."""
    dist.broadcast_object_list([command], src=0, group=_group.control)


def receive_command() -> Any:
    """Ranks 1..N-1: wait for rank 0's next command."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=_group.control)
    return box[0]
