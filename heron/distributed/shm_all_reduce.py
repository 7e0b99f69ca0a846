"""All-reduce (and gather) through shared memory, for tensor-parallel ranks that are processes of one x86 machine.

gloo's all-reduce over loopback TCP costs ~0.3-1 ms however small the tensor (a decode step's activations are a
few KiB), and a step makes two per layer: on the CPU that, not the matmuls, bounded a TP=2 step. vLLM's CPU
backend reduces through shared memory for the same reason. Here: each rank copies its tensor into its slot of a
shared segment and publishes the call's sequence number in its flag; once every flag shows it, each rank sums
the slots in rank order (so every rank gets the same bits). Two sets of slots alternate, so a rank may write
call k + 1 while a slower one still reads call k; it cannot get further ahead, since it waits for every flag of
call k + 1 first.

Ordering rests on x86's total store order: a rank's slot is written before its flag, and read after the flags
(so this path is off on other CPUs). A waiting rank spins briefly, then yields the core; it gives up when a
peer is declared dead (``abort``, set by rank 0's watcher), when rank 0's process is gone, or after the step
timeout.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np
import torch

SLOT_BYTES = 1 << 20  # tensors up to this size go through the segment (a decode step's are a few KiB)
_SPINS_BEFORE_YIELD = 2000


def supported() -> bool:
    """Whether this machine's memory order makes the protocol correct (x86) and a shared-memory dir exists."""
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def segment_bytes(size: int) -> int:
    return 64 * (size + 1) + 2 * size * SLOT_BYTES  # flags (a cache line each, and abort), two slot sets


class ShmAllReduce:
    """Rank ``rank`` of ``size``'s view of the segment at ``path`` (created, zeroed, by ``create``)."""

    def __init__(self, path: str, rank: int, size: int, timeout: float) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        segment = torch.from_file(path, shared=True, size=segment_bytes(size), dtype=torch.uint8)
        self.segment = segment  # keeps the mapping alive
        # one int64 per 64-byte line: flags of ranks 0..size-1, then the abort flag
        self.flags = segment[:64 * (size + 1)].numpy().view(np.int64)[::8]
        self.slots = segment[64 * (size + 1):].view(2, size, SLOT_BYTES)
        self.calls = 0
        self.parent = os.getppid()

    @staticmethod
    def create(path: str, size: int) -> None:
        """Create the zeroed segment file (rank 0, before the other ranks start)."""
        with open(path, "wb") as f:
            f.truncate(segment_bytes(size))

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        parts = self._exchange(x)
        torch.sum(parts, dim=0, out=x) if x.dtype == torch.float32 else x.copy_(parts.float().sum(dim=0))
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0 gets every rank's ``x`` concatenated along the last axis; the other ranks get their own back."""
        parts = self._exchange(x)
        return torch.cat(parts.unbind(0), dim=-1) if self.rank == 0 else x

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publish ``x`` in this rank's slot and wait for every rank's; returns the slots as [size, *x.shape]."""
        self.calls += 1
        nbytes = x.numel() * x.element_size()
        slots = self.slots[self.calls % 2]
        slots[self.rank, :nbytes].copy_(x.view(-1).view(torch.uint8))
        self.flags[self.rank] = self.calls  # after the data: x86 keeps stores in order
        self._wait(self.calls)
        return slots[:, :nbytes].view(x.dtype).view(self.size, *x.shape)

    def abort(self) -> None:
        """Make every rank's waiting call fail (a peer died)."""
        self.flags[self.size] = 1

    def _wait(self, call: int) -> None:
        flags, size = self.flags, self.size
        spins = 0
        deadline = None
        while flags[:size].min() < call:
            spins += 1
            if spins < _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()  # more ranks than free cores: let the one we wait for run
            if spins % 256:
                continue
            if flags[size]:
                raise RuntimeError("shared-memory all-reduce: a tensor-parallel rank died")
            if self.rank and os.getppid() != self.parent:
                raise RuntimeError("shared-memory all-reduce: rank 0's process is gone")
            now = time.monotonic()
            deadline = deadline or now + self.timeout
            if now > deadline:
                raise RuntimeError(f"shared-memory all-reduce: no peer answered within {self.timeout:.0f} s")
