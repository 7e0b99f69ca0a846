"""The attention-backend interface and the flat per-step metadata every backend reads.

A step is a flat batch of ``T`` new tokens from ``B`` sequences: sequence ``b`` computes the tokens
``query_start_loc[b]:query_start_loc[b+1]``, which are its last ``query_len`` positions of ``seq_lens[b]``
(prefill chunks, one decode token, or k+1 speculative verification tokens are the same thing with different
counts). New keys and values go to the pool slots ``slot_mapping``; a sequence's context is read through its
row of ``block_table``. A backend turns this into whatever it needs once per step (``prepare``) and owns the
layout of its per-layer KV tensor.

A pool may hold float8 (``--kv-cache-dtype fp8``): the backend quantizes what it stores and dequantizes what it
reads with one layer's ``KVScales``, so each attention layer gets its own copy of the backend (``for_layer``),
as each vLLM ``Attention`` layer owns its scales.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from heron.errors import ConfigError
from heron.quantization.kv import KVScales

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Flat inputs of one step, shared by every attention layer."""

    query_start_loc: torch.Tensor  # [B + 1] int32: offsets of each sequence's tokens in the flat batch
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    block_table: torch.Tensor  # [B, max_blocks] int32: pool block of each logical block
    slot_mapping: torch.Tensor  # [T] int64: pool slot of each new token
    query_lens: list[int]  # host copies, for builders that plan on the CPU
    context_lens: list[int]
    block_size: int
    prompt_rows: list[int] = field(default_factory=list)  # per sequence: its first rows that are prompt tokens
    # derived data a backend builds once per step in ``prepare`` (masks, index tensors, ...)
    backend_data: dict[Any, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(ABC):
    """Stores new keys/values into a paged pool and attends each query over its sequence's context."""

    name: str
    supports_fp8_kv: bool = False  # can store into and attend over a float8 pool
    kv_scales: KVScales = KVScales()  # this layer's scales (a float8 pool's; 1.0 elsewhere)
    calculate_kv_scales: bool = False  # set ``kv_scales`` from the first keys and values stored

    def for_layer(self, calculate_kv_scales: bool = False) -> AttentionBackend:
        """This backend for one attention layer, holding that layer's scales: 1.0, or with
        ``calculate_kv_scales`` computed from the first batch it stores (``KVScales.from_batch``)."""
        layer = copy.copy(self)
        layer.kv_scales = KVScales()
        layer.calculate_kv_scales = calculate_kv_scales
        return layer

    def scales_to_store(self, k: torch.Tensor, v: torch.Tensor) -> KVScales:
        """The scales to store ``k``, ``v`` with; the first call sets them when they are to be calculated."""
        if self.calculate_kv_scales:
            self.kv_scales = KVScales.from_batch(k, v)
            self.calculate_kv_scales = False
        return self.kv_scales

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV tensor (keys and values together)."""

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Build per-step derived data into ``meta.backend_data`` (called once per step, before the forward)."""

    @abstractmethod
    def store_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write keys and values [T, kv_heads, dim] into pool slots ``slots`` [T] (in this backend's layout),
        quantized with ``scales_to_store(k, v)`` into a float8 pool."""

    @abstractmethod
    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy pool blocks ``src`` to ``dst`` in one layer's KV tensor (copy-on-write)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        """``q``: [T, heads, dim]; ``k``, ``v``: [T, kv_heads, dim]. Writes k/v, returns [T, heads, dim]."""


def get_attention_backend(name: str = "auto", device: torch.device | None = None) -> AttentionBackend:
    """The backend called ``name``. ``auto``: the CPU paged kernel on the CPU (the reference backend, with a
    warning, where it cannot be built), the reference backend elsewhere (``triton_paged`` on CUDA is chosen by
    name until it has been run on a GPU: heron/attention/triton_paged.py)."""
    from heron.attention.reference import ReferenceBackend

    on_cpu = device is None or device.type == "cpu"
    if name == "reference" or (name == "auto" and not on_cpu):
        return ReferenceBackend()
    if name == "triton_paged":
        from heron.attention.triton_paged import ONLY_CUDA, TritonPagedBackend, interpreted

        if on_cpu and not interpreted():
            raise ConfigError(ONLY_CUDA)
        return TritonPagedBackend()
    if name not in ("auto", "cpu_paged"):
        raise ConfigError(f"unknown attention backend {name!r}; choose from auto, reference, cpu_paged, triton_paged")
    if not on_cpu:
        raise ConfigError("the cpu_paged attention backend runs on the CPU only")
    from heron.attention.cpu_paged import CpuPagedBackend

    try:
        return CpuPagedBackend()
    except Exception as e:  # noqa: BLE001 - no compiler, a failed build: the reference backend still works
        if name == "cpu_paged":
            raise
        logger.warning("the CPU paged-attention kernel is not available (%s: %s); using the reference backend",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return ReferenceBackend()
