"""The CPU paged backend: a C++ kernel reads keys and values in place through the block table.

Sequences with few queries this step (decodes, speculative verification: at most ``MAX_KERNEL_QUERIES``) go
through the kernel, whose cost grows with the positions each query attends, not with the batch's longest
context, and which never gathers a context into a new tensor. Long prefill chunks stay on the reference path
(gather + SDPA), where a blocked matmul beats a per-query loop. The kernel is built with
``torch.utils.cpp_extension`` at first use and cached under heron's cache directory, keyed by the source,
torch's version and the CPU's flags (it is compiled for this CPU); without a compiler the engine falls back to
the reference backend with one warning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from heron.attention.backend import AttentionMetadata
from heron.attention.reference import ReferenceBackend
from heron.cpu import cpu_flags

logger = logging.getLogger(__name__)

MAX_KERNEL_QUERIES = 16
_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


@functools.lru_cache(maxsize=1)
def load_kernel():
    """The compiled extension module (built once per source, torch version and CPU; then loaded from cache)."""
    from torch.utils.cpp_extension import load

    from heron.model.default_model import heron_cache_dir

    key = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()
                         + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    build_dir = heron_cache_dir() / "kernels" / f"paged_attention-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("loading the CPU paged-attention kernel (compiled into %s on first use)", build_dir)
    return load(name="heron_paged_attention", sources=[str(_SOURCE)], build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


class CpuPagedBackend(ReferenceBackend):
    """The reference layout and prefill path, with decode/verification queries through the C++ kernel."""

    name = "cpu_paged"

    def __init__(self) -> None:
        self.kernel = load_kernel()

    def prepare(self, meta: AttentionMetadata) -> None:
        few = [q <= MAX_KERNEL_QUERIES for q in meta.query_lens]
        starts = meta.query_start_loc.cpu()
        begin = starts[:-1].clone()
        end = torch.where(torch.tensor(few), starts[1:], begin)
        meta.backend_data["kernel"] = (begin.to(torch.int32), end.to(torch.int32), all(few))
        many = [b for b, f in enumerate(few) if not f]
        meta.backend_data["groups"] = [self._group(meta, many)] if many else []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        self._store(kv_cache, k, v, meta.slot_mapping)
        begin, end, _ = meta.backend_data["kernel"]
        out = self.kernel.paged_attention(q.to(kv_cache.dtype).contiguous(), kv_cache, meta.block_table,
                                          meta.seq_lens, begin, end, q.shape[-1] ** -0.5,
                                          sliding_window or 0).to(q.dtype)
        for group in meta.backend_data["groups"]:
            out[group.out_index] = self._attend(q, kv_cache, group, meta.block_size, sliding_window)
        return out
