"""Runs one model forward per step over the flat batch a ``SchedulerOutput`` describes.

The runner owns the model, the KV pool (one tensor per layer, laid out by the attention backend, in the model's
dtype or float8) and the persistent input batch; it returns the final hidden states of the rows whose logits
are wanted, and turns hidden states into logits on request (so prompt logprobs can be computed a slice at a
time).

With tensor parallelism, every rank has a runner over its shard of the model and of the KV pool; rank 0's (in
the engine core) has ``peers``, and each ``mirrored`` call it gets is first sent to the other ranks, which make
the same call (``heron/worker/worker.py``), so the collectives inside meet.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Protocol

import torch

from heron.attention.backend import AttentionBackend
from heron.engine.scheduler import SchedulerOutput
from heron.quantization.kv import is_fp8
from heron.worker.input_batch import InputBatch


class Peers(Protocol):
    """The other tensor-parallel ranks, as rank 0 sees them (``heron/distributed/executor.py``)."""

    def send(self, method: str, args: tuple, kwargs: dict) -> None:
        """Have every other rank call ``method(*args, **kwargs)`` on its runner."""

    def explain(self, error: BaseException) -> None:
        """Raise a clear error if ``error`` came from a rank that died; return otherwise."""


def mirrored(fn):
    """A runner call that every tensor-parallel rank makes: rank 0 has the others make it too, then makes it."""

    @functools.wraps(fn)
    def call(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        if self.peers is None:
            return fn(self, *args, **kwargs)
        try:
            self.peers.send(fn.__name__, args, kwargs)
            return fn(self, *args, **kwargs)
        except Exception as e:
            self.peers.explain(e)
            raise

    return call


class ModelRunner:
    """Owns the model, its paged KV pool and the persistent input batch."""

    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device, max_num_seqs: int,
                 max_model_len: int, max_num_tokens: int, backend: AttentionBackend) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.layers = model.attention_layers()
        self.num_kv_heads = self.layers[0].num_kv_heads
        self.head_dim = self.layers[0].head_dim
        self.max_blocks_per_seq = -(-max_model_len // block_size) + 1
        self.input_batch = InputBatch(max_num_seqs, self.max_blocks_per_seq, block_size, device, max_num_tokens)
        self.kv_caches: list[torch.Tensor] = []
        self.forward_seconds = 0.0  # time spent in the model forward, for overhead measurements
        self.peers: Peers | None = None  # rank 0 of several: the ranks its calls are mirrored to

    def bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, keys and values, in a pool of ``kv_dtype``."""
        return 2 * len(self.layers) * self.block_size * self.num_kv_heads * self.head_dim * kv_dtype.itemsize

    @mirrored
    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype, calculate_kv_scales: bool = False) -> None:
        """Allocate each layer's pool tensor once and hand it to the layer, with the layer's own view of the
        backend: a new pool starts with scales of 1.0, or (a float8 pool with ``calculate_kv_scales``) takes them
        from the first batch each layer stores."""
        self._drop_kv_cache()
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in self.layers]
        calculate = calculate_kv_scales and is_fp8(kv_dtype)
        for layer, cache in zip(self.layers, self.kv_caches, strict=True):
            layer.kv_cache = cache
            layer.backend = self.backend.for_layer(calculate)

    @mirrored
    def free_kv_cache(self) -> None:
        """Drop every reference to the pool (the runner's and the layers'), so its memory can be returned."""
        self._drop_kv_cache()

    def _drop_kv_cache(self) -> None:  # not mirrored: allocate_kv_cache's ranks each drop their own
        self.kv_caches = []
        for layer in self.layers:
            layer.kv_cache = None

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            for cache in self.kv_caches:
                self.backend.copy_blocks(cache, src, dst)

    @mirrored
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """One forward pass; returns the final hidden states of the wanted rows, in scheduled order."""
        self.input_batch.update(sched)
        self.copy_blocks(sched.block_copies)
        if not sched.seqs:
            return torch.empty(0)
        inputs = self.input_batch.prepare(sched)
        self.backend.prepare(inputs.meta)
        start = time.perf_counter()
        # the rows whose logits (or pooled states) are wanted, ascending; all of them: no selection
        keep = None if len(inputs.logits_index) == len(inputs.input_ids) else inputs.logits_index
        wanted = self.model(inputs.input_ids, inputs.positions, inputs.meta, keep=keep)
        self.forward_seconds += time.perf_counter() - start
        return wanted

    @mirrored
    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of some final hidden states."""
        return self.model.compute_logits(hidden).float()
